"""Build a wheelhouse of everything sweeper needs beyond the GPU node's own torch and Transformer Engine, for nodes
that reach no package registry (issue 44). Run it on a connected machine, in an environment with sweeper installed
and the nodes' Python (the same container image is best): it pins exactly the versions installed there.

    python scripts/wheelhouse.py WHEELHOUSE          # sweeper's wheel and its dependencies' wheels, nothing else
    scripts/install_offline.sh WHEELHOUSE            # on each node: pip install --no-index --find-links WHEELHOUSE

Left out (the node's own, never replaced): torch, Transformer Engine, triton and every nvidia-* wheel, and whatever
only they need. Lean: sweeper's optional extras are not followed. A dependency published only as a source archive
is built into a wheel here, so the node needs no build backend.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

# The node's own: its torch build (an NGC container's, a CUDA wheel), Transformer Engine and their CUDA libraries.
NODE_OWN = re.compile(r"^(torch|triton|pytorch-triton|transformer[-_]engine.*|nvidia-.*|cuda-.*)$", re.IGNORECASE)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_requirements(root: str = "sweeper") -> dict[str, str]:
    """name -> installed version of every distribution ``root`` needs (base dependencies and the extras its
    requirements name, e.g. ray[default], recursively), without the node's own. Exits with one line when a needed
    distribution is not installed here."""
    pins: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    todo: list[tuple[str, str, str]] = [(root, "", "")]  # (name, extra, wanted by)
    while todo:
        name, extra, wanted_by = todo.pop()
        key = canonical(name)
        if (key, extra) in seen or NODE_OWN.match(key):
            continue
        seen.add((key, extra))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"wheelhouse: {name} (needed by {wanted_by}) is not installed here; install sweeper first")
        pins[key] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(req.name, e, name) for e in ("", *sorted(req.extras))]
    return pins


def build(out: Path, project: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    pins = pinned_requirements()
    pins.pop("sweeper")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(out), str(project)], check=True)
    specs = [f"{name}=={version}" for name, version in sorted(pins.items())]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(out), *specs], check=True)
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheelhouse", type=Path, help="folder to write the wheels into")
    args = parser.parse_args()
    project = Path(__file__).resolve().parents[1]
    specs = build(args.wheelhouse, project)
    print(f"wheelhouse: sweeper and {len(specs)} dependencies in {args.wheelhouse} "
          "(torch, Transformer Engine and nvidia-* left to the node)")


if __name__ == "__main__":
    main()

"""The README's picture: throughput against peak memory of a real quickstart sweep's trials, as the report draws it.

Reads a sweep folder (``trials.jsonl``, ``sweep.json``) that ``sweeper search quickstart --out DIR`` wrote and saves
a PNG: every explored and confirmation trial that measured both figures, coloured by outcome, the stability limit
(the memory headroom) as a line, the winner marked. The report's interactive figure is plotly's; this one is
matplotlib's so the PNG needs no browser to render (the ``docs`` extra installs it).

    sweeper search quickstart --out /tmp/qs/sweep && python scripts/readme_figure.py /tmp/qs/sweep
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen

OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "quickstart_throughput_vs_memory.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="the sweep folder")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    meta = json.loads((args.sweep / "sweep.json").read_text())
    records = [json.loads(line) for line in (args.sweep / "trials.jsonl").read_text().splitlines() if line.strip()]
    limit = (1 - meta["memory_headroom"]) * meta["cluster"]["gpu_memory_gib"]
    best = (meta.get("best") or {}).get("layout")
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        m = r["result"].get("metrics") or {}
        if m.get("tokens_per_s") is None or m.get("peak_memory_gib") is None:
            continue
        kind = "confirmation" if r.get("phase") == "confirm" else (
            "passed" if r["result"]["status"] == "passed" else "failed")
        groups.setdefault(kind, []).append((m["peak_memory_gib"], m["tokens_per_s"]))
    styles = {"passed": ("tab:green", "o"), "failed": ("tab:red", "x"), "confirmation": ("tab:blue", "D")}
    for kind, points in groups.items():
        colour, marker = styles[kind]
        ax.scatter([p[0] for p in points], [p[1] for p in points], c=colour, marker=marker, label=kind, s=36)
    memory = [p[0] for points in groups.values() for p in points]
    if memory and limit <= 1.5 * max(memory):  # the limit is drawn only where the trials come near it
        ax.axvline(limit, color="grey", linestyle="--", label="stability limit (headroom)")
    ax.set_xlabel(f"peak memory per rank (GiB, {meta.get('memory_kind') or 'device'})")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{meta['name']}: throughput vs peak memory" + (f"; best {best}" if best else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

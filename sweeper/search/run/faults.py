"""Fault injection for the reliability tests (``search --inject KIND@trial=N``, simulated clusters only): which
fault the N-th launched trial gets. The trial runner and the simulated cluster carry the faults out. ``drift`` is
the layout's own numerical fault (one rank's gradient scaled from a later step on, backends/megatron/smoke.py), so
every run of that trial has it, its confirmation too (the trajectory check's test); the others hit its first run."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sweeper.errors import UsageError

INJECT_KINDS = ("node-loss", "node-join", "hang", "nan", "kill-rank", "drift")


@dataclass(frozen=True)
class Injection:
    kind: str
    trial: int  # the N-th launched trial (1-based)


def parse_injections(specs: list[str], simulated: bool) -> list[Injection]:
    out = []
    for spec in specs:
        match = re.fullmatch(r"([a-z-]+)@trial=([0-9]+)", spec.strip())
        if not match or match.group(1) not in INJECT_KINDS or int(match.group(2)) < 1:
            raise UsageError(f"--inject: '{spec}' is not one of {', '.join(k + '@trial=N' for k in INJECT_KINDS)}")
        out.append(Injection(match.group(1), int(match.group(2))))
    if out and not simulated:
        raise UsageError("--inject: fault injection only runs on simulated clusters (cluster.simulate)")
    return out


def injection_for(injections: list[Injection], nth: int) -> str | None:
    """The fault the nth launched trial runs with, in the runner's terms; None for none."""
    for inj in injections:
        if inj.trial == nth:
            if inj.kind in ("node-loss", "node-join"):
                return inj.kind  # the trial runner's handle performs these while the trial runs
            return {"kill-rank": "crash"}.get(inj.kind, inj.kind)
    return None

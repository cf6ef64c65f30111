"""The sweep's reference for the layout-equivalence gate: made once, loaded (resharded) by every trial.

The reference is a smoke run in the simplest layout the cluster can run (one GPU when the model fits, else the
smallest launchable layout of the space), in FP32 on the CPU backend (the gate's tolerance there is 1e-3) and in
the space's first precision on GPUs. Its global batch is a multiple of every data-parallel size the space can
produce, so every trial can take its slice of the reference batch. A sweep reuses an existing reference
(``--resume``). A sweep waits for the reference's GPUs and retries its infrastructure faults
(``search.run.reference``); when it still cannot be made, the sweep stops before its first trial, or (with
``search.require_equivalence: false``) runs its trials without the gate and says so.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from sweeper.config.schema import SweepConfig
from sweeper.models.proxy import is_proxy
from sweeper.plan.assess import assess_each
from sweeper.plan.space import enumerate_layouts
from sweeper.record.checkpoints import REFERENCE_FILE  # written last: its presence means the reference is complete
from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout
from sweeper.trial.protocol import Host, Reservation, reserved
from sweeper.trial.proxy_run import proxy_run_layout

PLACE_TIMEOUT_S = 120.0
NO_REFERENCE_LAYOUT = "equivalence gate off: no layout of this space can hold the reference"


class TrajectoryKey(NamedTuple):
    """What a confirmation's trajectory depends on beyond the reference weights and the steps: the global batch its
    run trains on, how it is cut into micro-batches (a MoE's load-balancing loss is a micro-batch's: two sequences
    in one micro-batch are not two in two) and the precision."""

    gbs: int
    mbs: int
    precision: str


@dataclass(frozen=True)
class Trajectory:
    """The reference layout's loss and gradient norm at each step of a confirmation's run: the same reference
    weights, global batch and micro-batches (the data is drawn per global sequence, whatever the layout, and each
    data-parallel rank's micro-batches are contiguous slices, so one rank at the same micro-batch size forms the same
    ones), steps and precision; made once per sweep and key and kept beside the reference (``trajectory_file``)."""

    layout: str  # Layout.short() of the run that made it
    precision: str
    gbs: int
    losses: list[float]
    grad_norms: list[float]


def trajectory_key(cfg: SweepConfig, layout: Layout) -> TrajectoryKey:
    """The key of ``layout``'s confirmation: the batch its run trains on (a proxy trial's share, ``proxy_run``)."""
    run = proxy_run_layout(layout) if is_proxy(cfg.model) else layout
    return TrajectoryKey(run.gbs, run.mbs, layout.precision)


def written_layout(folder: Path) -> Layout | None:
    """The layout that wrote the reference in ``folder`` (its reference.json), or None when unreadable."""
    try:
        return Layout.from_dict(json.loads((folder / REFERENCE_FILE).read_text())["layout"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def trajectory_file(folder: Path, key: TrajectoryKey, steps: int) -> Path:
    return folder / f"trajectory-gbs{key.gbs}-mbs{key.mbs}-{key.precision}-{steps}steps.json"


def read_trajectory(path: Path) -> Trajectory | None:
    try:
        return Trajectory(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def run_trajectory(cfg: SweepConfig, host: Host, folder: Path, layout: Layout, steps: int,
                   slot: Reservation) -> tuple[Trajectory | None, TrialResult]:
    """Run ``layout`` (``trajectory_layout``) for ``steps`` steps from the reference in ``folder`` on GPUs already
    reserved, and keep its trajectory there (None: the run failed)."""
    short = cfg.model_copy(update={"training": cfg.training.model_copy(update={"checkpoint": False})})
    path = trajectory_file(folder, TrajectoryKey(layout.gbs, layout.mbs, layout.precision), steps)
    result = host.run_trial(short, layout, folder.parent / f"{path.stem}-run", reservation=slot, steps=steps,
                            reference=str(folder))
    if not result.passed or len(result.losses) != steps or len(result.grad_norms) != steps:
        return None, result
    made = Trajectory(layout.short(), layout.precision, layout.gbs, result.losses, result.grad_norms)
    path.write_text(json.dumps(asdict(made)))
    return made, result


def trajectory_layout(cfg: SweepConfig, reference: Layout, key: TrajectoryKey) -> Layout | None:
    """The reference layout at a confirmation's batch, micro-batch size and precision; None when its data
    parallelism cannot split that batch. A proxy run caps its micro-batches per data-parallel rank, so for a proxy
    model the reference layout takes as many data-parallel copies as its own proxy run needs to keep the whole
    share (data parallelism alone: the simplest proven axis, and the run passes the gate itself)."""
    most = key.gbs // key.mbs if is_proxy(cfg.model) else 1
    for copies in range(1, most + 1):
        layout = replace(reference, world_size=reference.world_size * copies, gbs=key.gbs, mbs=key.mbs,
                         precision=key.precision)
        if layout.num_microbatches and (not is_proxy(cfg.model) or proxy_run_layout(layout).gbs == key.gbs):
            return layout
    return None


@dataclass(frozen=True)
class ReferenceOutcome:
    path: str | None  # the checkpoint folder every trial loads; None = gate off
    layout: Layout | None
    note: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "layout": self.layout.short() if self.layout else None, "note": self.note}


def reference_sequences(cfg: SweepConfig) -> int:
    """The gate's batch: a multiple of the data-parallel size of every trial the space can run. That is every
    world size (DP divides it); a proxy trial runs fewer replicas (``proxy_run``), so a proxy space's batch is
    a multiple of those only (every sequence is one micro-batch of the gate in every trial)."""
    if not is_proxy(cfg.model):
        return math.lcm(*cfg.world_sizes)
    return math.lcm(1, *{proxy_run_layout(lo).dp for lo in enumerate_layouts(cfg) if lo.dp})


def reference_layouts(cfg: SweepConfig, host: Any, precision: str | None = None) -> Iterator[Layout]:
    """The layouts this cluster can run the reference in (in ``precision``; default FP32 on a simulated cluster, the
    space's first precision on GPUs), simplest first: one GPU when the model fits, then the space's layouts by size
    and model parallelism. A sweep takes the next when one fails for its own reasons (out of memory: the estimator
    let it through inside its error band)."""
    sequences = reference_sequences(cfg)
    precision = precision or ("fp32" if host.simulated else cfg.space.values("precision")[0])
    single = Layout(world_size=1, gbs=sequences, precision=precision)
    simplest = list(dict.fromkeys([single] + sorted(
        # The reference is made with Megatron's DDP (equivalence.plan refuses Megatron-FSDP for it).
        (replace(lo, gbs=sequences, precision=precision, mbs=1, recompute="none", fsdp=None)
         for lo in enumerate_layouts(cfg)),
        key=lambda lo: (lo.world_size, lo.tp * lo.pp * lo.cp * lo.ep * lo.etp * lo.vpp),
    )))
    # Each layout without recompute, then with full recompute (the same arithmetic, less activation memory: what a
    # reference that ran out of memory tries before a layout of more parallelism).
    candidates = [variant for lo in simplest for variant in (lo, replace(lo, recompute="full"))]
    return (entry.layout for entry in assess_each(cfg, candidates, production=False)
            if entry.launchable and host.unsupported(cfg.model, entry.layout) is None)


def reference_layout(cfg: SweepConfig, host: Any, precision: str | None = None) -> Layout | None:
    """The simplest layout this cluster can run for the reference (``reference_layouts``' first), or None."""
    return next(reference_layouts(cfg, host, precision), None)


def _reusable(cfg: SweepConfig, folder: Path, precision: str | None = None) -> bool:
    """An existing reference serves this space when it is of the same model, sequence length, a batch every
    data-parallel size of the space divides and the precision asked for (if any), and records its batch's
    prefixes."""
    try:
        ref = json.loads((folder / REFERENCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if precision is not None and ref.get("precision") != precision:
        return False
    # "prefixes": a reference of the current format (2), which every trial's gate can compare on.
    return (ref.get("model") == cfg.model.model_dump() and ref.get("seq_length") == cfg.training.seq_length
            and ref.get("sequences", 0) % reference_sequences(cfg) == 0 and "prefixes" in ref)


def existing_reference(cfg: SweepConfig, folder: Path, precision: str | None = None) -> ReferenceOutcome | None:
    """The reference already in ``folder`` when it serves this space (``--resume``); one made for another model or
    space under the same name is deleted (None: it must be made)."""
    if (folder / REFERENCE_FILE).is_file():
        if _reusable(cfg, folder, precision):
            return ReferenceOutcome(str(folder), None, f"reusing the reference in {folder}")
        shutil.rmtree(folder)  # made for another model or space under the same name: make it again
    return None


def run_reference(cfg: SweepConfig, host: Host, folder: Path, layout: Layout,
                  slot: Reservation) -> tuple[ReferenceOutcome, TrialResult]:
    """Make the reference in ``layout`` on GPUs already reserved (the caller releases them): the outcome, and the
    run's result (whose failure kind says whether the layout or the infrastructure failed)."""
    short = cfg.model_copy(update={"training": cfg.training.model_copy(update={"checkpoint": False})})
    # No training steps: the reference is its fitted weights and their loss on the fixed batch.
    result = host.run_trial(short, layout, folder.parent / f"{folder.name}-run", reservation=slot, steps=0,
                            reference=str(folder), make_reference=True)
    if not result.passed or not (folder / REFERENCE_FILE).is_file():
        return ReferenceOutcome(None, layout, f"equivalence gate off: the reference run {layout.short()} failed "
                                f"({result.failure_kind}: {result.error})"), result
    return ReferenceOutcome(str(folder), layout, f"reference {layout.short()} made in {folder}"), result


def ensure_reference(cfg: SweepConfig, host: Host, folder: Path, precision: str | None = None) -> ReferenceOutcome:
    """The reference for one command (``sweeper trial``, scripts): reused, or made once with up to
    ``PLACE_TIMEOUT_S`` to find GPUs. A sweep waits for GPUs and retries faults instead (``search.run.reference``)."""
    existing = existing_reference(cfg, folder, precision)
    if existing is not None:
        return existing
    layout = reference_layout(cfg, host, precision)
    if layout is None:
        return ReferenceOutcome(None, None, NO_REFERENCE_LAYOUT)
    with reserved(host, layout, PLACE_TIMEOUT_S) as slot:
        if slot is None:
            return ReferenceOutcome(None, layout,
                                    f"equivalence gate off: no free GPUs for the reference {layout.short()}")
        return run_reference(cfg, host, folder, layout, slot)[0]

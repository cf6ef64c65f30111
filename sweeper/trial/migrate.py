"""`sweeper migrate`: move a checkpoint written by one layout into another, and prove the move (issue 17).

Top to bottom: both layouts pass the rules → the checkpoint: one sweeper wrote (``--checkpoint``: a sweep's
``reference/`` or a migration's ``from/``; it carries ``reference.json``, the loss and gradient norm of its weights
on a fixed batch), or one written now by a short run of the ``--from`` layout (the equivalence gate's reference
run, ``backends/megatron/equivalence.py``) → a trial of the ``--to`` layout that loads it (Megatron's resharding),
computes loss and gradient norm on the same batch (within the precisions' tolerance), trains its steps, saves and
reloads its own checkpoint → what changed: the tensors resharded, the optimizer state, each rank's load time and
their spread against the NCCL timeout a Megatron-LM run would have.

The checkpoint holds the model's weights only (the smoke run's torch_dist save): the optimizer state is not
moved, and the report says so.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.errors import LayoutError, UsageError
from sweeper.models.spec import ModelSpec
from sweeper.plan.rules import check
from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout
from sweeper.trial.host import open_host
from sweeper.trial.protocol import Host, reserved
from sweeper.trial.reference import REFERENCE_FILE

RESERVE_TIMEOUT_S = 60.0
# Megatron-LM's --distributed-timeout-minutes default (10): a rank that finishes loading this much later than its
# peers leaves them waiting in the first collective until NCCL gives up.
NCCL_TIMEOUT_S = 600.0
OPTIMIZER_STATE = ("not moved: the checkpoint holds the model's weights (torch_dist, every tensor resharded as "
                   "needed); the --to layout builds its optimizer afresh (Adam moments from zero, FP32 main copies "
                   "from the loaded weights)")


@dataclass
class Migration:
    """What ``sweeper migrate --json`` prints."""

    status: str  # passed | failed
    failure_kind: str | None
    error: str | None
    source: dict[str, Any]  # the layout that wrote the checkpoint (Layout.to_dict); JSON key "from"
    target: dict[str, Any]  # the layout it moved into; JSON key "to"
    checkpoint: str | None = None
    written_by: str | None = None  # "from run" (written now) | "given" (--checkpoint)
    tensors: int | None = None
    resharded: list[str] = field(default_factory=list)
    optimizer_state: str = OPTIMIZER_STATE
    load_s_per_rank: list[float | None] = field(default_factory=list)
    load_spread_s: float | None = None
    nccl_timeout_s: float = NCCL_TIMEOUT_S
    equivalence_rel_err: float | None = None
    steps_after_load: int = 0
    from_result: TrialResult | None = None
    to_result: TrialResult | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)  # the trial results too, as TrialResult.to_json writes them
        data["from"], data["to"] = data.pop("source"), data.pop("target")
        return data


def parse_layouts(cfg: SweepConfig, source: str, target: str) -> tuple[Layout, Layout]:
    """``--from`` and ``--to`` as full layouts (LayoutError naming the option on bad input)."""
    from sweeper.config.schema import layout_from_string

    out = []
    for option, text in (("--from", source), ("--to", target)):
        try:
            out.append(layout_from_string(cfg, text))
        except LayoutError as exc:
            raise LayoutError(f"{option}: {str(exc).removeprefix('--layout: ')}") from None
    return out[0], out[1]


def read_checkpoint(directory: Path) -> dict[str, Any]:
    """The reference.json of a checkpoint sweeper wrote (UsageError when it is not one)."""
    path = directory / REFERENCE_FILE
    if not path.is_file():
        raise UsageError(f"--checkpoint {directory}: no {REFERENCE_FILE} in it; migrate compares against the loss "
                         "recorded with the weights, so it takes a checkpoint sweeper wrote (a sweep's reference/ "
                         "folder or a migration's from/ folder)")
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--checkpoint {directory}: {REFERENCE_FILE} is unreadable ({exc})") from None
    return data


def incompatibility(cfg: SweepConfig, ref: dict[str, Any]) -> str | None:
    """Why a checkpoint (its reference.json) cannot move into a layout of this space, or None."""
    try:
        model = ModelSpec.model_validate(ref.get("model"))
    except ValueError:
        return "the checkpoint's reference.json names no model this version reads"
    if model != cfg.model:
        return (f"the checkpoint holds model {model.name!r} ({model.num_layers} layers, hidden {model.hidden_size}), "
                f"not this space's {cfg.model.name!r} ({cfg.model.num_layers} layers, hidden "
                f"{cfg.model.hidden_size}): tensors of another shape cannot be resharded into it")
    if ref.get("seq_length") != cfg.training.seq_length:
        return (f"the checkpoint's reference batch has sequences of {ref.get('seq_length')} tokens, this space's "
                f"training.seq_length is {cfg.training.seq_length} (give the same to compare losses)")
    return None


def migrate(cfg: SweepConfig, source: Layout, target: Layout, out: Path, *, checkpoint: Path | None = None,
            address: str | None = None) -> Migration:
    """Run the migration; never raises for a failed move (the Migration says what failed and why)."""
    ref: dict[str, Any] | None = None
    if checkpoint is not None:
        ref = read_checkpoint(checkpoint)
        written = Layout.from_dict(ref.get("layout") or {})
        if written.parallel_sizes() != source.parallel_sizes() or written.world_size != source.world_size:
            raise UsageError(f"--from {source.short()}: the checkpoint in {checkpoint} was written by "
                             f"{written.short()}")
    failed = _refusal(cfg, source, target, ref)
    if failed is not None:
        return failed
    # Its runs keep their checkpoints whatever training.keep_checkpoints says (issue 43): the --to run's holds the
    # moved weights in the new layout (after its steps). The one moved is the reference the --from run writes
    # (from/), which no run deletes.
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"keep_checkpoints": "all"})})
    with open_host(cfg, address) as host:
        for option, layout in (("--from", source), ("--to", target)):
            reason = host.unsupported(cfg.model, layout)
            if reason is not None:
                return _failed(source, target, "unsupported", f"{option} {layout.short()}: {reason}")
        from_result = None
        if checkpoint is None:
            checkpoint = out / "from"
            from_result = _write(cfg, host, source, target, checkpoint, out / "from-run")
            if not from_result.passed or not (checkpoint / REFERENCE_FILE).is_file():
                return _failed(source, target, from_result.failure_kind or "infra",
                               f"--from {source.short()} could not write the checkpoint: {from_result.error}",
                               from_result=from_result)
        with reserved(host, target, RESERVE_TIMEOUT_S) as slot:
            if slot is None:
                return _failed(source, target, "infra", f"no free GPUs for --to {target.short()} "
                               f"({target.world_size} GPUs)", from_result=from_result)
            to_result = host.run_trial(cfg, target, out / "to-run", reservation=slot, reference=str(checkpoint))
    return _outcome(source, target, checkpoint, from_result, to_result)


def _refusal(cfg: SweepConfig, source: Layout, target: Layout, ref: dict[str, Any] | None) -> Migration | None:
    """The checkpoint's model first (nothing else matters when it is another model), then the rules."""
    if ref is not None:
        reason = incompatibility(cfg, ref)
        if reason is not None:
            return _failed(source, target, "incompatible", reason)
    for option, layout in (("--from", source), ("--to", target)):
        reasons = check(cfg.model, layout, cfg.cluster, cfg.training.seq_length, cfg.run)
        if reasons:
            return _failed(source, target, "invalid_layout", f"{option} {layout.short()}: {'; '.join(reasons)}")
    return None


def _write(cfg: SweepConfig, host: Host, source: Layout, target: Layout, folder: Path, run_dir: Path) -> TrialResult:
    """The --from layout writes the checkpoint: the equivalence reference's short run (fitted weights, their loss
    and gradient norm on a fixed batch of sequences both layouts' data-parallel ranks can split)."""
    sequences = math.lcm(source.world_size * source.mbs, target.world_size)
    writer = replace(source, gbs=sequences)
    short = cfg.model_copy(update={"training": cfg.training.model_copy(update={"checkpoint": False})})
    with reserved(host, writer, RESERVE_TIMEOUT_S) as slot:
        if slot is None:
            return TrialResult(status="failed", failure_kind="infra", backend=host.backend_name,
                               error=f"no free GPUs for --from {source.short()} ({source.world_size} GPUs)")
        return host.run_trial(short, writer, run_dir, reservation=slot, steps=0, reference=str(folder),
                              make_reference=True)


def _outcome(source: Layout, target: Layout, checkpoint: Path, from_result: TrialResult | None,
             to_result: TrialResult) -> Migration:
    load = to_result.reference_load or {}
    times = [t for t in load.get("load_s", []) if t is not None]
    migration = Migration(
        status="passed", failure_kind=None, error=None, source=source.to_dict(), target=target.to_dict(),
        checkpoint=str(checkpoint), written_by="given" if from_result is None else "from run",
        tensors=load.get("tensors"), resharded=list(load.get("resharded", [])),
        load_s_per_rank=list(load.get("load_s", [])), load_spread_s=(max(times) - min(times)) if times else None,
        equivalence_rel_err=to_result.checks.equivalence_rel_err, steps_after_load=len(to_result.losses),
        from_result=from_result, to_result=to_result,
    )
    if not to_result.passed:
        migration.status, migration.failure_kind = "failed", to_result.failure_kind
        migration.error = f"--to {target.short()}: {to_result.error}"
    elif to_result.checks.equivalence_rel_err is None:
        skipped = next((n for n in to_result.notes if n.startswith("equivalence gate skipped")), "no comparison")
        migration.status, migration.failure_kind = "failed", "incompatible"
        migration.error = f"--to {target.short()} ran but the move is not proven: {skipped}"
    return migration


def _failed(source: Layout, target: Layout, kind: str, error: str, from_result: TrialResult | None = None
            ) -> Migration:
    return Migration(status="failed", failure_kind=kind, error=error, source=source.to_dict(),
                     target=target.to_dict(), from_result=from_result)


def default_out(cfg: SweepConfig, source: Layout, target: Layout) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("sweeps") / cfg.name / "migrations" / f"{source.short()}--{target.short()}-{stamp}"

"""The layout equivalence gate: proof that a layout computes the same model as the sweep's reference layout.

A sweep makes one *reference* (``SmokeRequest.make_reference=True``, in the simplest layout that fits): a torch_dist
checkpoint of the model's weights at ``reference_checkpoint``, with ``reference.json`` inside it holding the loss
and the gradient norm of one forward/backward on a fixed batch. Every trial then gets ``reference_checkpoint`` set:
right after its model is built (before its training steps change the weights) it loads the reference into its own
layout (Megatron's resharding across TP/PP/VPP/EP/ETP/DP), runs forward/backward on the same fixed batch, and
compares. The relative error max(|loss - ref| / |ref|, |norm - ref| / |ref|) is ``checks.equivalence_rel_err``;
beyond the precision's tolerance the trial fails with kind ``equivalence``. The trial's training steps then start
from the reference weights (the optimizer's main copies are reloaded).

The reference's weights are not the bare initialisation: at Megatron's std 0.02 a small model's logits are ~0 and
its loss is ln(vocab) whatever the weights, and a randomly initialised network with permuted weights is
statistically the same network, so a layout that scrambles a shard moves the loss and the gradient norm by ~1e-3
only (measured on tiny-gpt), no more than the FP32 tolerance. The reference therefore rescales the seeded
initialisation to unit gain and takes a few Adam steps on the first sequences of the fixed batch, stopping once their
loss is down to a quarter: its weights now encode them (tiny-gpt: loss 7.3 -> 1.4) and any layout that computes another
function loses it (the same fault: relative error ~4), while the loss and the gradients stay O(1) so that rounding noise
stays small relative to them.

Making the comparison layout-independent:
- The fixed batch is ``sequences`` token sequences (the reference layout's global batch size) drawn from the
  reference's seed. Each data-parallel rank takes its contiguous slice, one sequence per micro-batch: every
  micro-batch is the same single sequence in every layout, so per-micro-batch terms (the MoE load-balancing loss)
  are identical, and the mean loss over micro-batches and DP replicas is the mean over the whole batch.
- The gradient norm is Megatron's (the optimizer's ``prepare_grads`` + ``get_grad_norm``, no step): the norm of
  the main gradients after DP/EP synchronisation, summed over TP/PP/EP without counting replicated or shared
  parameters twice, FP16 loss scale removed.
- Megatron pads the vocabulary to a multiple of 128 x TP, so checkpoints of different TP have different embedding
  shapes. The reference pads to a multiple of ``REFERENCE_VOCAB_MULTIPLE`` (128 x 8: divisible by every
  power-of-two TP up to 8, and by more when the reference's own TP is larger) and every trial builds its model
  with the reference's padded vocabulary (the padding rows are never indexed by tokens; they only add a little
  output-layer work).
A trial whose layout cannot take the reference batch (vocabulary not divisible by its TP, sequences not by its DP,
interleaved pipeline with fewer micro-batches than PP, sequence not divisible by 2 x CP) is not the layout's fault:
the gate is skipped with a note and ``equivalence_rel_err`` stays None.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from sweeper.backends.base import RankReport, SmokeRequest
from sweeper.backends.megatron.failures import Phase, SmokeFailure
from sweeper.config.files import write_atomic
from sweeper.models.spec import ModelSpec
from sweeper.record.checkpoints import REFERENCE_FILE  # written last: its presence means the reference is complete
from sweeper.record.schema import GATE_SKIPPED
from sweeper.space.layout import Layout

if TYPE_CHECKING:
    from sweeper.backends.megatron.build import Built

FORMAT = 2  # 2: the loss and gradient norm of each prefix of the batch (``prefixes``)
REFERENCE_VOCAB_MULTIPLE = 128 * 8
# The reference's weights: Megatron's seeded initialisation at unit gain, then FIT_STEPS Adam steps on the fixed
# batch at lr FIT_LR_PER_STD x the unit-gain weight std (a few percent of a weight per step), see _fit. The fit
# runs on each rank's first FIT_MICRO_BATCHES sequences only: fitting breaks the symmetry of a random
# initialisation (what makes a scrambled shard visible) on any part of the batch, and every fitted sequence costs
# a forward/backward per step (a 16-sequence proxy reference spent 100 of its 120 s fitting).
FIT_STEPS = 5
FIT_MICRO_BATCHES = 4
# The fit stops once the fitted sequences' loss is at most this fraction of their loss before it. A reference fitted
# near a minimum makes the gate's relative errors rounding over a vanishing loss and gradient: tiny-5d (hidden 256,
# 8 experts) went 7.30 -> 0.03 in five steps, and its correct 16-rank BF16 layout then measured 5.2e-2 against it
# (gradient norm 0.36 vs 0.34 on the fitted sequences, the gate's four); tiny-gpt's five steps end at 0.19 (7.3 ->
# 1.4) with BF16 layouts at 4e-3. A quarter keeps the loss and the gradients O(1) while the weights encode the batch.
FIT_LOSS_FLOOR = 0.25
# The shortest prefix of the reference batch a trial's gate compares on (the tolerances below were measured on
# four sequences).
GATE_MIN_SEQUENCES = 4
FIT_LR_PER_STD = 0.025

# Largest relative error (loss and gradient norm) a layout may show against the reference, by precision. Layouts
# differ only in summation order (TP partial sums, DP averaging, EP token order), so the error is rounding noise
# of the compute precision, amplified through depth and the number of ranks; the trial uses the looser of its own
# precision's and the reference's. Each measured tolerance is GATE_MARGIN x the worst known-correct layout in
# tests/data/gate_error.json (scripts/measure_gate_error.py: every axis alone at two ranks on tiny-gpt, tiny-moe and
# both flagship proxies, and the mission's 16-rank 5D layout), checked by tests/backends/test_gate_tolerance.py.
# Against a BF16 reference instead of the FP32 one the worst correct BF16 layout measured more, not less (5.8e-3
# against 3.8e-3 at two ranks: MoE routing ties flip in BF16), so on the CPU one FP32 reference serves every precision.
GATE_MARGIN = 2.0
TOLERANCE: dict[str, float] = {
    # 24-bit mantissa (unit roundoff 6e-8): 1e-3 is the project's requirement; the worst correct layout measured
    # 5.1e-7 (DeepSeek proxy TP2-EP2-SP), a wrong shard 4.06.
    "fp32": 1e-3,
    # 11-bit mantissa (roundoff 4.9e-4) with FP32 main grads and loss: measured 3.6e-4 (tiny-gpt TP2), a 14x margin.
    "fp16": 5e-3,
    # 8-bit mantissa (roundoff 3.9e-3), FP32 reference: worst correct 3.8e-3 at two ranks, 1.45e-2 on the 16-rank 5D
    # layout (TP2 PP2 CP2 EP4 SP); 2 x 1.45e-2 rounded up. A wrong shard measures 4.06. A defect that moves the
    # gradient by ~2% (MLA's rotary-key gradient under TP without SP measured 2.1e-2) is not separable from
    # rounding in BF16: the FP32 gate (1e-3) is where the CPU backend proves a layout (tests/test_proxy_matrix.py).
    "bf16": 3e-2,
    # Not measured (FP8 and MXFP8 need TE on a GPU; gpu_check's fp8-dense-bf16-ref case measures it): by roundoff,
    # FP8 GEMM inputs (e4m3: 3-bit mantissa, roundoff 6e-2, per-tensor scaled; MXFP8: per-32-element block
    # scales), the gate's first iteration after one discarded one that fills delayed scaling's amax history.
    # Averaging over the batch brings the loss/norm error well below the element roundoff; 5e-2 still separates a
    # wrong layout, whose error is O(1e-1) or more on the gradient norm.
    "fp8": 5e-2,
    "mxfp8": 5e-2,
    # NVFP4 GEMM inputs (e2m1: 1-bit mantissa, per-16-element E4M3 scales and a per-tensor FP32 scale; random
    # Hadamard transforms and stochastic rounding on the gradients): element roundoff ~25%, four times FP8's. Not
    # measured (no Blackwell GPU has run it): 1e-1 keeps an O(1) wrong-shard error apart.
    "nvfp4": 1e-1,
}

_log = logging.getLogger("sweeper.equivalence")


class EquivalenceError(SmokeFailure):
    """The layout's loss or gradient norm on the reference batch differs from the reference's beyond tolerance."""

    kind = "equivalence"


class ReferenceError(SmokeFailure):
    """The reference cannot be made or read (missing, other model, unusable layout): the sweep's setup, not the
    trial's layout."""

    kind = "infra"


@dataclass(frozen=True)
class Reference:
    """The content of reference.json."""

    format: int
    model: dict  # ModelSpec.model_dump() of the reference's model
    layout: dict  # the reference's Layout.to_dict()
    precision: str
    seed: int  # draws the fixed batch (and the initial weights)
    sequences: int  # the fixed batch: this many sequences ...
    seq_length: int  # ... of this many tokens
    vocab_size: int  # padded vocabulary of the checkpoint; trials build with it
    loss: float
    grad_norm: float
    loss_before_fit: float  # the unit-gain initial weights' loss on the batch (about ln(vocab)); for the record
    # The loss and gradient norm on the batch's first k sequences, for each k the reference layout can split
    # (a divisor of ``sequences`` and a multiple of its DP): a trial compares on the shortest prefix its own
    # data-parallel ranks split, one or more sequences each (see ``gate_sequences``). JSON keys are strings.
    prefixes: dict[str, list[float]]

    def on(self, sequences: int) -> tuple[float, float]:
        """(loss, gradient norm) on the first ``sequences`` sequences."""
        if sequences == self.sequences:
            return self.loss, self.grad_norm
        loss, norm = self.prefixes[str(sequences)]
        return loss, norm



def reference_vocab_size(vocab_size: int, reference_tp: int) -> int:
    """The reference's padded vocabulary: a multiple of 128 x 8 and of Megatron's own 128 x TP."""
    multiple = math.lcm(REFERENCE_VOCAB_MULTIPLE, 128 * reference_tp)
    return -(-vocab_size // multiple) * multiple


def tolerance(precision: str, reference_precision: str) -> float:
    return max(TOLERANCE.get(precision, TOLERANCE["fp8"]), TOLERANCE.get(reference_precision, TOLERANCE["fp8"]))


def rel_err(value: float, reference: float) -> float:
    if not math.isfinite(value):
        return math.inf
    return abs(value - reference) / max(abs(reference), 1e-12)


def read_reference(directory: str | Path) -> Reference:
    path = Path(directory) / REFERENCE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReferenceError(f"equivalence reference {path} does not exist (make it first: make_reference=True)") \
            from None
    except (OSError, ValueError) as exc:
        raise ReferenceError(f"equivalence reference {path} is unreadable: {exc}") from exc
    if data.get("format") != FORMAT:
        raise ReferenceError(f"equivalence reference {path} has format {data.get('format')}, expected {FORMAT}")
    return Reference(**{k: data[k] for k in Reference.__dataclass_fields__})


def gate_sequences(ref: Reference, layout: Layout) -> int:
    """The sequences a trial's gate runs: the shortest measured prefix of the reference batch that its DP ranks
    split evenly, with at least PP micro-batches each under the interleaved schedule (every sequence costs a
    forward/backward of the whole model; the gate proves the same equivalence on any of them, and the prefixes
    are GATE_MIN_SEQUENCES long or more, so BF16's rounding still averages over as many tokens as the tolerances
    were measured on)."""
    per_rank = layout.pp if layout.vpp > 1 else 1
    measured = sorted({ref.sequences, *map(int, ref.prefixes)})
    return next((k for k in measured if k % layout.dp == 0 and k // layout.dp >= per_rank), ref.sequences)


def _prefix_lengths(layout: Layout) -> list[int]:
    """The prefixes a reference measures: divisors of its batch below it, split by its DP, of at least
    GATE_MIN_SEQUENCES."""
    return [k for k in range(layout.dp, layout.gbs, layout.dp) if layout.gbs % k == 0 and k >= GATE_MIN_SEQUENCES]


@dataclass
class Plan:
    """What the gate does in this run, decided before the model is built (the build needs the vocabulary)."""

    mode: Literal["make", "check"]
    directory: Path
    vocab_size: int | None  # padded vocabulary to build with; None: the default
    reference: Reference | None = None  # check mode
    skip_reason: str | None = None  # check mode: the layout cannot take the reference batch
    # Megatron-FSDP: the reference was loaded into the bare chunks before build wrapped them (before_wrap), as
    # the report's reference_load records it.
    preloaded: dict | None = None


def plan(request: SmokeRequest) -> Plan | None:
    """None when the request asks nothing of the gate."""
    spec, layout = request.model, request.layout
    if not request.reference_checkpoint:
        if request.make_reference:
            raise ReferenceError("make_reference needs reference_checkpoint: the directory to write the reference to")
        return None
    directory = Path(request.reference_checkpoint)
    if request.make_reference:
        if layout.gbs % layout.dp:
            raise ReferenceError(f"reference layout: gbs={layout.gbs} is not divisible by dp={layout.dp}")
        if layout.fsdp:  # its fit and save work on DDP's plain parameters
            raise ReferenceError(f"reference layout: made without Megatron-FSDP, got fsdp={layout.fsdp}")
        return Plan("make", directory, reference_vocab_size(spec.vocab_size, layout.tp))
    ref = read_reference(directory)
    if ModelSpec.model_validate(ref.model) != spec:
        raise ReferenceError(
            f"equivalence reference {directory} was made for model {ref.model.get('name')!r} with other settings "
            f"than this trial's model {spec.name!r}"
        )
    per_dp = ref.sequences // layout.dp
    skip = None
    if ref.vocab_size % layout.tp:
        skip = f"the reference's padded vocabulary {ref.vocab_size} is not divisible by tp={layout.tp}"
    elif ref.sequences % layout.dp:
        skip = f"the reference batch of {ref.sequences} sequences does not split over dp={layout.dp}"
    elif layout.vpp > 1 and per_dp < layout.pp:
        skip = (f"the interleaved pipeline needs at least pp={layout.pp} micro-batches, the reference batch gives "
                f"{per_dp} per data-parallel rank")
    elif ref.seq_length % (2 * layout.cp) and layout.cp > 1:
        skip = f"the reference sequence length {ref.seq_length} is not divisible by 2 x cp={2 * layout.cp}"
    return Plan("check", directory, None if skip else ref.vocab_size, ref, skip)


def before_wrap(gate: Plan | None, layout: Layout,
                enter: Callable[[Phase], None]) -> Callable[[list[torch.nn.Module]], None] | None:
    """For build's ``before_wrap``: with Megatron-FSDP the reference is loaded into the bare chunks (a torch_dist
    checkpoint loads into the bare model, not into Megatron-FSDP's wrapped one, measured); None otherwise (DDP
    layouts load into the built model, ``run``)."""
    if gate is None or gate.mode != "check" or gate.skip_reason or not layout.fsdp:
        return None

    def load(chunks: list[torch.nn.Module]) -> None:
        from sweeper.backends.megatron import checkpoint as ckpt

        assert gate is not None and gate.reference is not None
        enter("checkpoint_load")
        keys, moved = ckpt.resharding(chunks, gate.directory)
        started = time.perf_counter()
        ckpt.load_chunks(chunks, gate.directory)
        gate.preloaded = {"layout": gate.reference.layout, "tensors": keys, "resharded": moved,
                          "load_s": time.perf_counter() - started}
        enter("build")

    return load


def fixed_batch(seed: int, sequences: int, seq_length: int, vocab_size: int, device: torch.device,
                first: int | None = None) -> list:
    """This data-parallel rank's share of the reference batch (of its ``first`` sequences, default all): one
    sequence per micro-batch."""
    from megatron.core import parallel_state

    from sweeper.backends.megatron.steps import Batch

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    seqs = torch.randint(0, vocab_size, (sequences, seq_length + 1), generator=torch.Generator().manual_seed(seed))
    seqs = seqs[: first or sequences]
    per = len(seqs) // dp
    positions = torch.arange(seq_length).unsqueeze(0).to(device)
    return [
        Batch(s[None, :-1].to(device), s[None, 1:].contiguous().to(device), positions)
        for s in seqs[dp_rank * per : (dp_rank + 1) * per]
    ]


def measure(built: Built, batches: list, seq_length: int) -> tuple[float, float]:
    """(loss, gradient norm) of one forward/backward on ``batches``; the weights are left unchanged."""
    from sweeper.backends.megatron.steps import forward_backward

    loss = forward_backward(built, batches, seq_length, micro_batch_size=1)
    # Main grads ready (FP16: unscaled; its scaler counts one more good step, harmless), no optimizer step.
    found_inf = built.optimizer.prepare_grads()
    norm = math.nan if found_inf else float(built.optimizer.get_grad_norm())
    for chunk in built.model:
        chunk.zero_grad_buffer()
    built.optimizer.zero_grad()
    return loss, norm


@contextmanager
def local_graphs_off(model: list[torch.nn.Module]) -> Iterator[None]:
    """The gate's forwards and backwards run eagerly and record no local CUDA graph.

    megatron-core 0.16.1's CudaGraphManager (transformer/cuda_graphs.py) records each graphed layer on its first
    training forward, and every schedule captures what was recorded at its end (schedules.py create_cudagraphs),
    so the gate's forward/backward (one sequence per micro-batch) would become the captured shape: the steps at
    another micro-batch size then fail "cudagraph_created is set to True but no matching cudagraph runners were
    found" (one pipeline stage) or "CUDA graph argument mismatch" (several), and another micro-batch count breaks
    the per-micro-batch runners of a pipeline. A layer without its ``cudagraph_manager`` submodule runs as a plain
    module (MegatronModule.__call__ asks ``_should_call_local_cudagraph``: hasattr), nothing is recorded,
    create_cudagraphs returns on the empty record, and the steps' first step records and captures their own shape,
    as Megatron-LM's first iteration does. Nothing is captured here, so there is nothing to delete afterwards."""
    hidden = [(module, manager) for chunk in model for module in list(chunk.modules())
              if (manager := dict(module.named_children()).get("cudagraph_manager")) is not None]
    for module, _ in hidden:
        delattr(module, "cudagraph_manager")
    try:
        yield
    finally:
        for module, manager in hidden:
            module.cudagraph_manager = manager


def run(
    gate: Plan,
    request: SmokeRequest,
    built: Built,
    report: RankReport,
    device: torch.device,
    enter: Callable[[Phase], None],
) -> None:
    """Make the reference, or load it and compare (raises EquivalenceError beyond tolerance); local CUDA graphs
    off throughout (local_graphs_off)."""
    with local_graphs_off(built.model):
        _run(gate, request, built, report, device, enter)


def _run(
    gate: Plan,
    request: SmokeRequest,
    built: Built,
    report: RankReport,
    device: torch.device,
    enter: Callable[[Phase], None],
) -> None:
    from sweeper.backends.megatron import checkpoint as ckpt

    spec, layout = request.model, request.layout

    if gate.mode == "make":
        enter("steps")
        batches = fixed_batch(request.seed, layout.gbs, request.seq_length, spec.vocab_size, device)
        _unit_gain(built, spec)
        chance_loss = _fit(built, batches[: max(FIT_MICRO_BATCHES, layout.pp)], request.seq_length, FIT_STEPS,
                           FIT_LR_PER_STD / math.sqrt(spec.hidden_size))
        enter("checkpoint_save")
        ckpt.save(built, gate.directory)
        enter("steps")
        loss, norm = measure(built, batches, request.seq_length)
        prefixes = {}
        for k in _prefix_lengths(layout):
            prefix = fixed_batch(request.seed, layout.gbs, request.seq_length, spec.vocab_size, device, first=k)
            prefixes[str(k)] = list(measure(built, prefix, request.seq_length))
        if not all(math.isfinite(v) for v in (loss, norm, *(x for pair in prefixes.values() for x in pair))):
            raise ReferenceError(f"the reference run's loss {loss} / gradient norm {norm} is not finite")
        reference = Reference(
            format=FORMAT, model=spec.model_dump(), layout=layout.to_dict(), precision=layout.precision,
            seed=request.seed, sequences=layout.gbs, seq_length=request.seq_length, vocab_size=built.vocab_size,
            loss=loss, grad_norm=norm, loss_before_fit=chance_loss, prefixes=prefixes,
        )
        if torch.distributed.get_rank() == 0:
            # Written last and atomically: a reference.json means the reference is complete.
            write_atomic(gate.directory / REFERENCE_FILE, json.dumps(asdict(reference), indent=2) + "\n")
        torch.distributed.barrier()
        report.equivalence = {"loss": loss, "grad_norm": norm}
        report.notes.append(f"equivalence reference written to {gate.directory}")
        _log.info("equivalence reference: loss %.7f grad_norm %.7f", loss, norm)
        return

    ref = gate.reference
    assert ref is not None
    if gate.skip_reason:
        report.notes.append(f"{GATE_SKIPPED}: {gate.skip_reason}")
        _log.warning("equivalence gate skipped: %s", gate.skip_reason)
        return
    if gate.preloaded is not None:  # Megatron-FSDP: loaded before wrapping; the optimizer was built from it
        report.reference_load = gate.preloaded
    else:
        enter("checkpoint_load")
        report.reference_load = _load_reference(built, gate.directory, ref)
    sequences = gate_sequences(ref, layout)
    batches = fixed_batch(ref.seed, ref.sequences, ref.seq_length, spec.vocab_size, device, first=sequences)
    if scales_from_history(built.config) and gate.preloaded is None:
        # Delayed scaling computes each FP8 scale from the amax history, which is empty before the first FP8
        # iteration: the gate would run at scale 1 (E5M2 gradients of ~1e-6 underflow to zero), and FP8 weights
        # (fp8_param) were quantized at scale 1 when the reference was loaded. A discarded forward/backward on the
        # gate's batch fills the history (no step: the weights are unchanged), and the reference is loaded again,
        # quantized at the scales it set; the gate then compares what a run past its first iteration computes.
        enter("steps")
        measure(built, batches, ref.seq_length)
        enter("checkpoint_load")
        _load_reference(built, gate.directory, ref)
        report.notes.append("FP8 delayed scaling: one discarded forward/backward filled the amax history before "
                            "the equivalence gate, and the reference was loaded again at its scales")
    if request.inject == "swap_shards":
        _swap_shards(built)
    enter("steps")
    loss, norm = measure(built, batches, ref.seq_length)
    report.checks.forward_backward = True  # the layout's forward and backward ran, whatever the gate finds
    ref_loss, ref_norm = ref.on(sequences)
    err = max(rel_err(loss, ref_loss), rel_err(norm, ref_norm))
    report.equivalence = {"loss": loss, "grad_norm": norm, "sequences": sequences}
    report.checks.equivalence_rel_err = err
    limit = tolerance(layout.precision, ref.precision)
    _log.info("equivalence: loss %.7f (ref %.7f) grad_norm %.7f (ref %.7f) rel_err %.3g tolerance %.3g",
              loss, ref_loss, norm, ref_norm, err, limit)
    if not err <= limit:
        raise EquivalenceError(
            f"layout does not compute the reference model: loss {loss:.6g} vs {ref_loss:.6g}, gradient norm "
            f"{norm:.6g} vs {ref_norm:.6g} on {sequences} sequences of the reference batch (relative error "
            f"{err:.3g} > {limit:g}, "
            f"{layout.precision})"
        )


def scales_from_history(config: object) -> bool:
    """Whether the run's FP8 scales come from an amax history (Transformer Engine's delayed scaling), which the
    first FP8 iteration finds empty. Current scaling (tensorwise), blockwise and MXFP8 scale each tensor from itself."""
    return bool(getattr(config, "fp8", None)) and getattr(config, "fp8_recipe", None) == "delayed"


def _load_reference(built: Built, directory: Path, ref: Reference) -> dict:
    """Load (reshard) the reference into the built chunks; what reference_load records of it."""
    from sweeper.backends.megatron import checkpoint as ckpt

    chunks = built.bare_chunks()
    keys, moved = ckpt.resharding(chunks, directory)
    started = time.perf_counter()
    ckpt.load_chunks(chunks, directory)
    # The optimizer's FP32 main copies (mixed precision, distributed optimizer) still hold the built weights.
    built.optimizer.reload_model_params()
    return {"layout": ref.layout, "tensors": keys, "resharded": moved, "load_s": time.perf_counter() - started}


def _fit(built: Built, batches: list, seq_length: int, steps: int, lr: float) -> float:
    """A few Adam steps on the fixed batch (the reference's weights then encode it), fewer once its loss is down to
    FIT_LOSS_FLOOR of where it started; returns the loss before."""
    from sweeper.backends.megatron.steps import forward_backward

    groups = built.optimizer.param_groups
    saved = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = lr
    first = math.nan
    for i in range(steps):
        loss = forward_backward(built, batches, seq_length, micro_batch_size=1)
        first = loss if i == 0 else first
        if i > 0 and loss <= FIT_LOSS_FLOOR * first:
            _log.info("reference fit: loss %.4f is within %.2f of %.4f, stopped before step %d", loss, FIT_LOSS_FLOOR,
                      first, i + 1)
            break
        built.optimizer.step()
        _log.info("reference fit step %d: loss %.4f (lr %.3g)", i + 1, loss, lr)
    for g, value in zip(groups, saved):
        g["lr"] = value
    return first


def _unit_gain(built: Built, spec: ModelSpec) -> None:
    """Rescale the freshly initialised weight matrices to std ~1/sqrt(hidden) (unit gain).

    Megatron initialises with std 0.02, which is unit gain for hidden ~2500; in a small model it makes every
    layer's output tiny, the logits ~0 and the loss ln(vocab) whatever the weights: a layout that scrambles a
    weight then changes the loss and gradient norm by ~1e-3 only (measured on tiny-gpt), too close to the FP32
    tolerance to prove anything. At unit gain the output depends on every weight. One factor for all matrices
    (norms and biases untouched) keeps Megatron's relative scales (e.g. its scaled output-projection init) and
    needs no knowledge of how a tensor is sharded."""
    gain = 1.0 / (built.config.init_method_std * math.sqrt(spec.hidden_size))
    with torch.no_grad():
        for ddp in built.model:
            for param in ddp.module.parameters():
                if param.dim() >= 2:
                    param.mul_(gain)
    built.optimizer.reload_model_params()


def _swap_shards(built: Built) -> None:
    """Test fault: a wrong layout. Every decoder layer's fc1 weight takes the next TP rank's shard (TP=1: its two
    halves swap), while fc2 keeps its own: hidden units meet the wrong output columns."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        for ddp in built.model:
            for name, param in ddp.module.named_parameters():
                if not (name.endswith("mlp.linear_fc1.weight") and "decoder.layers." in name):
                    continue
                if tp == 1:
                    param.copy_(torch.roll(param, param.shape[0] // 2, dims=0))
                    continue
                shards = [torch.empty_like(param) for _ in range(tp)]
                torch.distributed.all_gather(shards, param.detach().contiguous(), group=group)
                rank = parallel_state.get_tensor_model_parallel_rank()
                param.copy_(shards[(rank + 1) % tp])
    built.optimizer.reload_model_params()

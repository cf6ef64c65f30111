"""The smoke run of one rank: init → build → equivalence gate → N steps → replica check → save → reload → delete
the checkpoint unless kept → routing stress (MoE confirmations) → report.

``run_rank`` is called in a rank's process after the runner has set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
and LOCAL_RANK. It never raises: every failure becomes a RankReport with ok=False, a failure kind and a
one-line root cause; the traceback goes to ``<trial_dir>/rank_<r>.log``. Megatron is imported only after the
request has been checked against what this backend supports, so an unsupported layout costs milliseconds.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from sweeper.backends.base import RankReport, SmokeRequest, share_checks
from sweeper.backends.megatron.cpu import compat
from sweeper.backends.megatron.device import check_declared_capability, rank_device, transformer_engine_present
from sweeper.backends.megatron.failures import (
    InvalidLayoutError,
    NonFiniteError,
    Phase,
    ReplicaDivergenceError,
    SimulatedOOMError,
    UnsupportedError,
    classify,
)
from sweeper.backends.megatron.memory import (
    MemoryWatchdog,
    PeakResident,
    PhasePeak,
    StepsPeak,
    host_memory_bytes,
    non_torch_device_bytes,
    peak_memory_bytes,
)
from sweeper.backends.megatron.routing import RoutingProbe
from sweeper.backends.megatron.support import backend_name, run_unsupported_reason, unsupported_reason
from sweeper.config.units import GIB
from sweeper.estimate.step_time import model_flops_per_token
from sweeper.models.proxy import PROXY_NOTE, is_proxy
from sweeper.models.spec import ModelSpec
from sweeper.record.checkpoints import checkpoint_folder, delete_checkpoint, folder_bytes
from sweeper.space.layout import Layout

if TYPE_CHECKING:
    from sweeper.backends.megatron.build import Built

T = TypeVar("T")

INJECT_STEP = 2  # fault injection fires at the second training step (steps count from 1)
# Fault injection "drift": from this step on, the injected rank's loss (so its share of the gradient, before the
# data-parallel reduction) is scaled by DRIFT_SCALE. The gate (before the steps) cannot see it; the step's gradient
# norm moves by about (DRIFT_SCALE - 1) / DP, the loss only from the next step on, slowly.
DRIFT_FROM_STEP = 3
DRIFT_SCALE = 1.05
_log = logging.getLogger("sweeper.smoke")


def run_rank(request: SmokeRequest) -> RankReport:
    """Run this rank's part of the smoke trial and report what it proved. Never raises."""
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    report = RankReport(
        rank=rank,
        node_id=os.environ.get("SWEEPER_NODE_ID") or socket.gethostname(),
        backend=backend_name(cuda),
        ok=False,
        memory_kind="device" if cuda else "host",
    )
    share_checks(report.checks)
    handler = _open_rank_log(request.trial_dir, rank)
    watchdog: MemoryWatchdog | None = None
    progress = _Progress()
    try:
        try:
            spec, layout = request.model, request.layout
            if cuda:  # before anything else: a trial on another device than declared measures another run
                # A runner that gives each rank one visible GPU (Ray sets CUDA_VISIBLE_DEVICES) still passes
                # LOCAL_RANK.
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
                report.compute_capability = check_declared_capability(request.compute_capability, rank)
            te = cuda and transformer_engine_present()
            reason = (run_unsupported_reason(request.run, cuda=cuda, te=te)
                      or unsupported_reason(spec, layout, cuda=cuda, te=te))
            if reason:
                raise UnsupportedError(reason)
            if request.memory_limit_gib is not None and not cuda:
                watchdog = MemoryWatchdog(int(request.memory_limit_gib * GIB)).start()

            _smoke(request, spec, layout, cuda, te, report, watchdog, progress)
        finally:
            if watchdog is not None:
                watchdog.stop()
    except BaseException as exc:  # noqa: BLE001 - the contract: every failure becomes a report
        kind, error = classify(exc, progress.phase)
        if isinstance(exc, SimulatedOOMError) and watchdog is not None and watchdog.exceeded_bytes:
            error = str(watchdog.error())
        if progress.phase == "stress":
            error = f"under routing stress (tokens forced onto hot experts): {error}"
        report.ok, report.failure_kind, report.error = False, kind, error
        _log.error("rank %d failed in %s: [%s] %s", rank, progress.phase, kind, error, exc_info=exc)
    finally:
        if not report.peak_memory_bytes:  # set before the routing stress: the normal run's peak
            report.peak_memory_bytes = peak_memory_bytes(cuda)
        _teardown()
        _close_rank_log(handler)
    return report


@dataclass
class _Progress:
    """The phase the run is in, to classify an exception raised anywhere inside it."""

    phase: Phase = "setup"

    def enter(self, phase: Phase) -> None:
        self.phase = phase
        _log.info("phase: %s", phase)


def _smoke(
    request: SmokeRequest,
    spec: ModelSpec,
    layout: Layout,
    cuda: bool,
    te: bool,
    report: RankReport,
    watchdog: MemoryWatchdog | None,
    progress: _Progress,
) -> None:
    enter = progress.enter
    run = request.run

    def safe_point() -> None:
        if watchdog is not None:
            watchdog.check()

    # -- init: process group and Megatron's parallel groups ------------------------------------------------------
    enter("init")
    start = time.perf_counter()
    compat.install()
    from megatron.core import parallel_state

    # Importing megatron-core is most of a fresh rank process's start-up; timed apart from the rendezvous.
    report.timings_s["import"] = time.perf_counter() - start
    start = time.perf_counter()
    torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=request.timeout_s))
    world = torch.distributed.get_world_size()
    if world != layout.world_size:
        raise RuntimeError(f"WORLD_SIZE is {world} but the layout needs {layout.world_size} ranks")
    enter("build")  # Megatron validates the parallel sizes here: a failure is the layout's
    parallel_state.initialize_model_parallel(
        **layout.parallel_sizes(),
        distributed_timeout_minutes=request.timeout_s / 60,
        # Megatron's gloo twins of its groups: unused by a smoke run (optimizer-state checkpoints only), and on
        # NCCL they need a gloo-reachable interface on every node. Off on both backends, so the CPU runs this too.
        create_gloo_process_groups=False,
    )
    report.checks.process_group = True
    report.timings_s["init"] = time.perf_counter() - start
    from sweeper.backends.megatron.placement import gpu_index, process_groups

    report.groups, report.gpu = process_groups(), gpu_index()  # proof of placement (trial/aggregate.py)
    safe_point()

    # -- build: config, model chunks, DDP, optimizer -----------------------------------------------------------------
    from sweeper.backends.megatron import equivalence
    from sweeper.backends.megatron.build import build
    from sweeper.backends.megatron.steps import check_finite, micro_batches, train_step

    start = time.perf_counter()
    if layout.num_microbatches == 0:
        raise InvalidLayoutError(
            f"global_batch_size ({layout.gbs}) must be divisible by micro_batch_size ({layout.mbs}) x "
            f"data-parallel size ({layout.dp})"
        )
    if request.inject == "bug":
        _injected_bug(layout)
    gate = equivalence.plan(request)  # reads the reference: the build takes its vocabulary size
    built = build(spec, layout, cuda=cuda, te=te, seed=request.seed, vocab_size=gate.vocab_size if gate else None,
                  run=run, before_wrap=equivalence.before_wrap(gate, layout, enter))
    report.checks.model_built = True
    if cuda:  # which spec ran where the choice exists (the CPU always runs the local one)
        report.notes.append(f"layer spec: {'Transformer Engine' if te else 'local (torch), no Transformer Engine'}")
    if is_proxy(spec):
        report.notes.append(PROXY_NOTE)
    if te:  # the FP8 recipe chosen for this device, a missing Mamba fast path (gpu.py; not run on a GPU yet)
        from sweeper.backends.megatron.gpu import device_plan

        report.notes.extend(device_plan(spec, layout, run).notes)
    report.timings_s["build"] = time.perf_counter() - start
    report.tokens_per_step = layout.gbs * request.seq_length
    report.flops_per_step = report.tokens_per_step * model_flops_per_token(spec, request.seq_length, built.vocab_size)
    safe_point()

    device = rank_device()

    # -- equivalence gate: on the freshly built model, before the steps change its weights -----------------------
    if gate is not None:
        _timed(report, "equivalence",
               lambda: equivalence.run(gate, request, built, report, device, enter))
        safe_point()

    # -- steps ---------------------------------------------------------------------------------------------------------
    enter("steps")
    # The steps' peak starts here: build, the reference load and the gate are the peak before the steps.
    steps_peak = StepsPeak(cuda)
    report.pre_steps_peak_memory_bytes = steps_peak.before_bytes
    if not steps_peak.resettable:
        report.notes.append("peak memory includes build and the equivalence gate (the kernel refused to reset the "
                            "peak resident set)")
    probe = RoutingProbe(built.model) if spec.is_moe and layout.ep > 1 else None
    is_injected = request.inject is not None and report.rank == request.inject_rank
    steps_start = time.perf_counter()
    for step in range(1, request.steps + 1):
        if is_injected and step == INJECT_STEP:
            _inject(request, report)
        batches = micro_batches(
            seed=request.seed, step=step, layout=layout, seq_length=request.seq_length,
            vocab_size=spec.vocab_size, device=device,
        )
        start = time.perf_counter()
        result = train_step(
            built, layout, batches, request.seq_length,
            poison=is_injected and request.inject == "nan" and step == INJECT_STEP,
            drift=DRIFT_SCALE if is_injected and request.inject == "drift" and step >= DRIFT_FROM_STEP else 1.0,
        )
        if cuda:
            torch.cuda.synchronize()
        report.step_times_s.append(time.perf_counter() - start)
        report.losses.append(result.loss)
        report.grad_norms.append(result.grad_norm)
        report.checks.forward_backward = True
        _log.info("step %d loss %.5f grad_norm %.5f time %.3fs", step, result.loss, result.grad_norm,
                  report.step_times_s[-1])
        if result.skipped:
            report.notes.append(f"step {step}: optimizer step skipped by the FP16 loss scaler")
        check_finite(step, result)
        safe_point()
        if request.checkpoint and request.checkpoint_every and step % request.checkpoint_every == 0 \
                and step != request.steps:
            # Reloaded bit-identical, so training goes on from exactly the weights it would have had.
            mid_start = time.perf_counter()
            steps_peak.pause()  # the phase peaks stay disjoint too
            built.sync_params()  # save the step's weights, not the shards a deferred all-gather has not brought
            _save_and_reload(request, built, report, step, enter, safe_point, cuda)
            steps_peak.resume()
            steps_start += time.perf_counter() - mid_start  # the phase times stay disjoint
            enter("steps")
    report.timings_s["steps"] = time.perf_counter() - steps_start
    # The trial's peak is the steps' (before the replica check and the saves); on a GPU with what the device holds
    # outside torch's allocator beside it, so the stability check compares what the GPU really holds.
    report.peak_memory_bytes = steps_peak.peak_bytes()
    if cuda:
        report.non_torch_memory_bytes = non_torch_device_bytes()
    report.checks.finite = all(math.isfinite(x) for x in report.losses)
    if probe is not None:  # one all-reduce over the EP group: how unevenly the router loaded the EP ranks
        report.moe_hot_rank_factor = probe.hot_rank_factor(layout.ep, device)

    # -- replicas: every copy of a replicated parameter bit-identical (before the checkpoint keeps one of them) --
    enter("replicas")
    from sweeper.backends.megatron.replicas import check_replicas

    # The step's weights everywhere, not the all-gather deferred to the next forward (the final save reads them too).
    built.sync_params()

    compared = 0
    try:
        compared = _timed(report, "replicas", lambda: check_replicas(built, request.steps, device))
    except ReplicaDivergenceError:
        report.checks.replicas_consistent = False
        raise
    report.checks.replicas_consistent = True if compared else None

    # -- checkpoint: save, reload into the same model, compare bitwise; then its size, and unless kept, delete it -
    if request.checkpoint:
        _save_and_reload(request, built, report, request.steps, enter, safe_point, cuda)
        _settle_checkpoint(request, report)  # its last use: the routing stress below does not read it

    # -- routing stress (MoE finalists): last, so the trial's own figures are the normal run's -------------------
    if request.routing_stress_steps and spec.is_moe and layout.ep > 1:
        enter("stress")
        report.routing_stress = _routing_stress(request, built, device, cuda, safe_point)

    enter("report")
    torch.distributed.barrier()  # nobody tears the process group down while a peer still uses it
    report.ok = True


def _routing_stress(request: SmokeRequest, built: Built, device: torch.device, cuda: bool,
                    safe_point: Callable[[], None]) -> dict[str, dict[str, Any]]:
    """A few steps per stress mode with the router forced onto hot experts; each mode's peak memory on this rank,
    the hot-rank factor the forcing produced (proof it concentrated the tokens) and whether the steps stayed
    finite (recorded, not a failure: forced routing is not training). Running out of memory here fails the trial
    (the winner must keep its headroom under stress)."""
    from sweeper.backends.megatron.routing import STRESS_MODES, RoutingProbe, forced_routing
    from sweeper.backends.megatron.steps import check_finite, micro_batches, train_step

    layout = request.layout
    out: dict[str, dict[str, Any]] = {}
    for mode in STRESS_MODES:
        probe = RoutingProbe(built.model)
        finite = True
        with PhasePeak(cuda) as peak, forced_routing(built.model, mode, layout.ep):
            for step in range(1, request.routing_stress_steps + 1):
                batches = micro_batches(seed=request.seed + 1, step=step, layout=layout,
                                        seq_length=request.seq_length, vocab_size=request.model.vocab_size,
                                        device=device)
                result = train_step(built, layout, batches, request.seq_length)
                try:
                    check_finite(step, result)  # the steps' own verdict (a skipped FP16 step is finite), not raised
                except NonFiniteError:
                    finite = False
                _log.info("routing stress %s step %d loss %.5f grad_norm %.5f", mode, step, result.loss,
                          result.grad_norm)
                safe_point()
        out[mode] = {"peak_memory_bytes": peak.peak_bytes, "hot_rank_factor": probe.hot_rank_factor(layout.ep, device),
                     "finite": finite}
    return out


def _save_and_reload(
    request: SmokeRequest, built: Built, report: RankReport, step: int, enter: Callable[[Phase], None],
    safe_point: Callable[[], None], cuda: bool,
) -> None:
    """torch_dist save of the weights after ``step``, then reload into the poisoned model and compare bitwise.

    The checks (and the result's checkpoint) are the last save's; an earlier save that fails raises, failing the
    trial as checkpoint_error. The phase's peak memory is its own figure (checkpoint_peak_memory_bytes): the
    snapshot it compares against lives in host memory, so the phase adds no copy of the weights on the GPU.
    """
    with PhasePeak(cuda) as peak:
        _save_and_compare(request, built, report, step, enter, safe_point)
    report.checkpoint_peak_memory_bytes = max(report.checkpoint_peak_memory_bytes or 0, peak.peak_bytes)


def _save_and_compare(
    request: SmokeRequest, built: Built, report: RankReport, step: int, enter: Callable[[Phase], None],
    safe_point: Callable[[], None],
) -> None:
    from sweeper.backends.megatron import checkpoint as ckpt

    final = step == request.steps
    directory = ckpt.checkpoint_path(request.trial_dir, step)
    saved = ckpt.snapshot(built)
    saved_extra = ckpt.extra_states(built.bare_chunks()) if not built.fsdp else None
    enter("checkpoint_save")
    with PeakResident() as resident:
        report.checkpoint_save_s = _seconds(report, "checkpoint_save", lambda: ckpt.save(built, directory))
    report.checkpoint_save_rss_bytes = resident.peak_bytes
    report.host_memory_bytes = host_memory_bytes(request.host_memory_gib)
    if final:
        report.checks.checkpoint_saved = True
        report.checkpoint_dir = str(directory)
    safe_point()
    enter("checkpoint_load")
    report.checkpoint_load_s = _seconds(report, "checkpoint_load",
                                        lambda: ckpt.reload_and_compare(built, directory, saved, saved_extra))
    if final:
        report.checks.checkpoint_reloaded = True


def _settle_checkpoint(request: SmokeRequest, report: RankReport) -> None:
    """The trial's checkpoint folder after its last reload (issue 43): rank 0 records its bytes and, unless the
    request keeps it, deletes it once every rank has read it back (the barrier).

    One rank deletes for the whole trial: every rank wrote its shards into this one folder, and on several nodes
    it is on a filesystem they share (the reload already depends on that: every rank reads the metadata rank 0
    wrote), so a deleter per node would race on the same tree. A deletion that fails is a note, never the trial's
    failure; the folder then stays (a sweep's end prunes it, search/checkpoints.py)."""
    if not request.keep_checkpoint:
        torch.distributed.barrier()
    if report.rank != 0:
        return
    folder = checkpoint_folder(request.trial_dir)
    report.checkpoint_bytes = folder_bytes(folder)
    if request.keep_checkpoint:
        return
    problem = delete_checkpoint(folder)
    if problem is None:
        report.checkpoint_deleted = True
        _log.info("checkpoint deleted after its reload: %s (%d bytes)", folder, report.checkpoint_bytes)
    else:
        report.notes.append(f"checkpoint kept: {problem}")


def _inject(request: SmokeRequest, report: RankReport) -> None:
    if request.inject == "hang":
        _log.warning("fault injection: rank %d hangs at step %d", report.rank, INJECT_STEP)
        while True:
            time.sleep(1.0)
    if request.inject == "crash":
        _log.warning("fault injection: rank %d exits with code 17 at step %d", report.rank, INJECT_STEP)
        logging.shutdown()
        os._exit(17)
    if request.inject == "nan":
        _log.warning("fault injection: rank %d poisons its output with NaN at step %d", report.rank, INJECT_STEP)
    if request.inject == "drift":
        _log.warning("fault injection: rank %d scales its gradient by %g from step %d", report.rank, DRIFT_SCALE,
                     DRIFT_FROM_STEP)


def _injected_bug(layout: Layout) -> None:
    """Fault injection "bug": fail the way a bug in sweeper's build code fails (a wrong call, here)."""
    _log.warning("fault injection: sweeper's build path raises a TypeError")
    layout.parallel_sizes(layout)  # type: ignore[call-arg]


def _timed(report: RankReport, key: str, action: Callable[[], T]) -> T:
    start = time.perf_counter()
    try:
        return action()
    finally:
        report.timings_s[key] = report.timings_s.get(key, 0.0) + time.perf_counter() - start


def _seconds(report: RankReport, key: str, action: Callable[[], object]) -> float:
    """``_timed``, returning this run's seconds (the phase's total adds up every run)."""
    before = report.timings_s.get(key, 0.0)
    _timed(report, key, action)
    return report.timings_s[key] - before


def _open_rank_log(trial_dir: str, rank: int) -> logging.Handler | None:
    """Send this process's logging (sweeper's and Megatron's) to <trial_dir>/rank_<r>.log."""
    try:
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(Path(trial_dir) / f"rank_{rank}.log")
    except OSError:
        return None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    return handler


def _close_rank_log(handler: logging.Handler | None) -> None:
    if handler is not None:
        logging.getLogger().removeHandler(handler)
        handler.close()


def _teardown() -> None:
    """Release Megatron's groups and the process group so the process can run another trial."""
    try:
        if torch.distributed.is_initialized():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown after a failure must not mask the report
        _log.warning("teardown failed", exc_info=True)

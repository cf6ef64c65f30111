"""A rehearsal (issue 46): the real sweep driver against modelled trials on the YAML's cluster, no GPU and no Ray.

``sweeper search SPACE --rehearse`` runs what a sweep runs (the frontier, the scheduler and its GPU ledger, the
study, the refit, the records, MLflow, the report), but ``RehearsalHost.run_trial`` models each trial instead of
launching it. Its outcome is the estimator's prediction with the estimator's error drawn at the size its held-out
figures measure: one level for the cluster, and per layout a factor per step-time term and a factor on the whole
step (together the held-out spread of a layout about its group's level), a factor on the memory per layout (out of
memory where the drawn peak exceeds the GPU), and a small noise per run. Its duration is the phases of a smoke run
(start-up growing with the ranks, build, the gate reading the reference, steps, checkpoint save and reload through
a filesystem the running trials share); a trial longer than ``training.trial_timeout_s`` fails as ``timeout``, as a
real one does. Faults come at the rates given
(``--rehearse-faults node_loss_per_hour=R,hang=P,others=SHARE``: other jobs holding a varying share of the
cluster's nodes). A trial takes no real time: a virtual clock moves to the next
trial's end whenever the driver waits for one (``advance``), so a sweep of hours rehearses in minutes, in the order a
real sweep would see its trials end.

The draws are the rehearsal's *truth*: ``truth(layout)`` is what a layout would measure without noise, from which
the summary counts the trials the sweep needed to reach a layout within the noise of the modelled best valid layout,
and every run is logged (``Ledger.log``) so that the summary can replay the sweep under other levels of the truth
(its band). Every output says it is a rehearsal; nothing of it reaches the calibration cache real sweeps read.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sweeper.cluster.connection import NodeInfo
from sweeper.cluster.doctor import DoctorReport
from sweeper.cluster.placement import CPUS_PER_RANK
from sweeper.config.files import write_atomic
from sweeper.config.kernels import Kernels
from sweeper.config.schema import SweepConfig
from sweeper.errors import UsageError
from sweeper.estimate import Estimator
from sweeper.estimate.disk import checkpoint_bytes
from sweeper.estimate.step_time import StepTerms, model_flops_per_token
from sweeper.record.checkpoints import REFERENCE_FILE
from sweeper.record.schema import REHEARSAL_BACKEND, TrialChecks, TrialMetrics, TrialResult
from sweeper.space.layout import Layout
from sweeper.trial.host import TrialHost
from sweeper.trial.protocol import Reservation
from sweeper.trial.reference import reference_sequences

BACKEND = REHEARSAL_BACKEND
NOTE = "rehearsal: modelled from the estimator, not measured"
# What a smoke run spends around its steps, modelled: rank processes started and megatron-core imported, the process
# groups made, the model built, the equivalence gate (the reference read from the shared filesystem and resharded,
# and one forward/backward: about two step times), and its checkpoint written and read back.
START_S = 60.0
# The rendezvous and the NCCL communicators grow with the ranks: every rank registers with one TCPStore and each of
# Megatron's process groups is made on all of them. MegaScale (Jiang et al., NSDI '24, section 3.5 "fast
# initialization") reports 1,047 s to initialise a 2,048-GPU job with stock PyTorch before its fixes (about half a
# second per rank); a smoke trial runs stock PyTorch, so its start-up grows by that much per rank (a 1,024-GPU trial
# starts in about 10 minutes). The model's build does not: each rank builds its own shard, in parallel.
START_S_PER_RANK = 1047.0 / 2048
BUILD_S = 30.0
GATE_STEPS = 2.0
# The shared filesystem: each node reads and writes at FS_GB_S, and all the trials running at once share
# FS_SHARED_GB_S (an assumption: the YAML names no filesystem; a parallel filesystem of this order serves a cluster
# of a few hundred GPUs). A trial's I/O gets its share of the filesystem as it stands when the trial starts.
FS_GB_S = 2.0
FS_SHARED_GB_S = 100.0
# The estimator's error, drawn as its held-out figures measure it (benchmarks/first_guess.py --json, each published
# family predicted with the defaults fitted on the others, 63 layouts, issue 52's dispatch term): a level per
# rehearsal (the root mean square of each group's median log(predicted / measured): ``after.level_sigma`` 0.121),
# and per layout the spread about its group's level (``after.layout_sigma``: each layout's log ratio less its
# group's median: 0.115; a median error of 11.3% per layout with the level). The layout's spread is drawn as a
# factor per step-time term (TERM_SIGMA: what a term-by-term fit leaves, ~10% median) and a factor on the whole
# step that brings the layout's spread to LAYOUT_SIGMA (the terms alone average out: a step of k equal terms would
# spread by TERM_SIGMA / sqrt(k)). A run's noise between repeats is a GPU's few percent. The memory's is the
# estimator's own band (estimate.memory_over/under_prediction, 20%), as one sigma.
LEVEL_SIGMA = 0.121
LAYOUT_SIGMA = 0.115
TERM_SIGMA = 0.10
RUN_SIGMA = 0.03

# Other jobs on a shared cluster (``--rehearse-faults others=SHARE``): every OTHERS_PERIOD_S of the virtual clock
# they hold a new share of the nodes, drawn uniformly between 0 and SHARE, on nodes the sweep does not use then
# (a scheduler gives a job free nodes); the sweep waits for what they hold as it waits on a real cluster.
OTHERS_PERIOD_S = 3600.0
KEYS = ("node_loss_per_hour", "hang", "others")


@dataclass(frozen=True)
class Faults:
    """``--rehearse-faults``: node losses per node-hour of a trial, the chance that a trial hangs, and the largest
    share of the cluster's nodes other jobs hold (a varying share, ``OTHERS_PERIOD_S``)."""

    node_loss_per_hour: float = 0.0
    hang: float = 0.0
    others: float = 0.0

    @classmethod
    def parse(cls, text: str | None) -> Faults:
        """``node_loss_per_hour=0.01,hang=0.02``; bad input raises UsageError naming the item."""
        values: dict[str, float] = {}
        for item in (text or "").split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if key not in KEYS or not sep:
                raise UsageError(f"--rehearse-faults: {item!r} is not node_loss_per_hour=RATE, hang=P or others=SHARE")
            try:
                number = float(value)
            except ValueError:
                raise UsageError(f"--rehearse-faults: {key} must be a number, got {value!r}") from None
            if number < 0 or (key == "hang" and number > 1) or (key == "others" and number >= 1) \
                    or not math.isfinite(number):
                raise UsageError(f"--rehearse-faults: {key} must be in [0, 1] for hang, in [0, 1) for others, >= 0 "
                                 f"for a rate; got {value}")
            values[key] = number
        return cls(**values)


def term_shares(terms: StepTerms) -> list[float]:
    """How much of the step each term's factor moves (d log step / d log factor): a stage term counts in every
    micro-batch and in the bubble's slots; they sum to 1."""
    total = terms.seconds()
    if total <= 0:
        return []
    slots = terms.microbatches + terms.bubble_slots
    shares = [s * slots / total for s in terms.stage.values()]
    shares.append(terms.bubble_slots * sum(terms.stage.values()) / total)
    shares.extend(s / total for s in terms.step.values())
    return shares


@dataclass(frozen=True)
class Run:
    """A modelled run as the virtual clock saw it, kept so that the summary can replay the sweep under another level
    of the truth: ``fixed_s`` (start-up, build, I/O) and ``step_s`` (the steps, the gate's included: what the level
    scales) make its whole length; it ended at ``fraction`` of that (a lost node), or at ``limit_s`` (the trial's
    timeout: a hang, or a run longer than it)."""

    start_s: float
    fixed_s: float
    step_s: float
    gpus: int
    limit_s: float
    fraction: float = 1.0
    hung: bool = False

    def duration(self, scale: float = 1.0) -> float:
        """Its length on the virtual clock with every step ``scale`` times as long."""
        if self.hung:
            return self.limit_s
        return min(self.limit_s, (self.fixed_s + self.step_s * scale) * self.fraction)


@dataclass(frozen=True)
class Truth:
    """What a layout measures in this rehearsal without a run's noise."""

    peak_memory_gib: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float


@dataclass
class Ledger:
    """What the rehearsal spent, on the virtual clock."""

    gpu_s: float = 0.0  # busy: each run's GPUs for its length
    peak_trials: int = 0
    peak_disk_bytes: int = 0
    runs: int = 0  # runs modelled, the reference and confirmations included
    kept_bytes: int = 0  # checkpoints of ended trials left on disk (training.keep_checkpoints winner or all)
    log: list[Run] = field(default_factory=list)  # every run, in the order they started


class _ModelledCluster:
    """The YAML's nodes for TrialHost's GPU ledger: nothing runs on them; other jobs hold what ``held`` says (the
    rehearsal host's ``others_held``), and what the sweep itself reserved (``used``) is taken too, as Ray says."""

    is_simulated = False
    simulated = None

    def __init__(self, cfg: SweepConfig) -> None:
        c = cfg.cluster
        # A CPU per rank, as the ranks of a real run reserve: the CPUs never limit a modelled node.
        self._nodes = [NodeInfo(f"node-{i}", f"node-{i}", f"node-{i}", c.gpus_per_node,
                                c.gpus_per_node * CPUS_PER_RANK, i == 0) for i in range(c.nodes)]
        self.held: Callable[[], dict[str, int]] = dict
        self.used: Callable[[], dict[str, int]] = dict

    def nodes(self) -> list[NodeInfo]:
        return list(self._nodes)

    def available(self) -> dict[str, tuple[float, float]]:
        held, used = self.held(), self.used()
        return {n.node_id: (float(max(0, n.gpus - held.get(n.node_id, 0) - used.get(n.node_id, 0))), n.cpus)
                for n in self._nodes}


class RehearsalHost(TrialHost):
    """TrialHost's GPU ledger over the YAML's cluster, with modelled trials on a virtual clock (module docstring)."""

    def __init__(self, cfg: SweepConfig, faults: Faults, seed: int = 0) -> None:
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"warm_ranks": False})})
        cluster = _ModelledCluster(cfg)
        super().__init__(cfg, cluster)  # type: ignore[arg-type]
        cluster.held, cluster.used = self.others_held, lambda: dict(self._used)
        self._other_jobs: tuple[int, dict[str, int]] = (-1, {})  # (the period drawn, node -> GPUs other jobs hold)
        self.backend_name = BACKEND
        self.faults = faults
        self.seed = seed
        self.estimator = Estimator.for_config(cfg)
        # The same for every layout (the summary asks the truth of every valid layout: tens of thousands, issue 54)
        self._flops_per_token = model_flops_per_token(cfg.model, cfg.training.seq_length)
        self.level = math.exp(random.Random(f"{seed}:level").gauss(0.0, LEVEL_SIGMA))
        self.ledger = Ledger()
        self._clock = 0.0
        self._cond = threading.Condition()
        self._ends: dict[int, float] = {}  # id(reservation) -> virtual end of the trial running on it
        self._starting: dict[int, float] = {}  # id(reservation) -> virtual start, until its trial registers
        self._disk: dict[int, int] = {}  # id(reservation) -> checkpoint bytes it holds while running
        self._truth: dict[Layout, Truth | None] = {}
        self._reference_bytes = 0  # the reference's checkpoint stays on disk for the whole sweep

    # -- the virtual clock ---------------------------------------------------------------------------------------
    def now(self) -> float:
        """The virtual clock's seconds since the rehearsal started."""
        with self._cond:
            return self._clock

    def advance(self) -> None:
        """The driver waits for a trial to end: the clock moves to the earliest end of the trials running. Trials
        reserved but not yet started by their thread are waited for (briefly, in real time) so none is skipped.
        With none running (the sweep waits for GPUs other jobs hold), the clock moves to the next change of what
        they hold."""
        deadline = time.monotonic() + 10.0
        with self._cond:
            while self._starting and time.monotonic() < deadline:
                self._cond.wait(0.01)
            if self._ends:
                self._clock = max(self._clock, min(self._ends.values()))
                self._cond.notify_all()
            elif self.faults.others > 0:
                self._clock = (math.floor(self._clock / OTHERS_PERIOD_S) + 1) * OTHERS_PERIOD_S
                self._snapshot = None  # the ledger reads the nodes again: what other jobs hold has changed
                self._cond.notify_all()

    def others_held(self) -> dict[str, int]:
        """GPUs other jobs hold now, per node: whole nodes, a share drawn per period of the virtual clock among the
        nodes the sweep does not use when the period starts (``Faults.others``)."""
        if self.faults.others <= 0:
            return {}
        period = int(self._clock // OTHERS_PERIOD_S)
        if period != self._other_jobs[0]:
            rng = self._draw("others", period)
            free = [n.node_id for n in self.handle.nodes() if not self._used.get(n.node_id)]
            rng.shuffle(free)
            share = rng.uniform(0.0, self.faults.others)
            count = min(len(free), round(share * self.cfg.cluster.nodes))
            self._other_jobs = (period, {nid: self.cfg.cluster.gpus_per_node for nid in free[:count]})
            self._snapshot = None
        return self._other_jobs[1]

    def reserve(self, layout: Layout, alone: bool = False) -> Reservation | None:
        slot = super().reserve(layout, alone)
        if slot is not None:
            with self._cond:
                self._starting[id(slot)] = self._clock
        return slot

    def release(self, reservation: Reservation) -> None:
        super().release(reservation)
        self._released.clear()  # the modelled nodes free a trial's GPUs at once: no grace for Ray's lag (issue 51)
        with self._cond:
            self._starting.pop(id(reservation), None)
            self._ends.pop(id(reservation), None)
            self._disk.pop(id(reservation), None)
            self._cond.notify_all()

    # -- what the host can run ------------------------------------------------------------------------------------
    @property
    def kernels(self) -> Kernels:
        """A GPU cluster with Transformer Engine and the optional kernels (what a production cluster has)."""
        return Kernels(transformer_engine=True, mamba_ssm=True, causal_conv1d=True, deep_ep=True)

    def prestart(self, layouts: list[Layout]) -> int:
        return 0

    def doctor(self, cfg: SweepConfig, trial_root: Path | None = None) -> DoctorReport:
        return DoctorReport(nodes=[], problems=[], expected_nodes=cfg.cluster.nodes)

    def add_node(self) -> str:
        raise RuntimeError("a rehearsal models its faults (--rehearse-faults); --inject is for simulated clusters")

    # -- the model ------------------------------------------------------------------------------------------------
    def _draw(self, *key: object) -> random.Random:
        digest = hashlib.sha256(repr((self.seed, *key)).encode()).hexdigest()
        return random.Random(int(digest[:16], 16))

    def truth(self, layout: Layout) -> Truth | None:
        """The layout's measurement in this rehearsal, without a run's noise (None: the estimator cannot price it)."""
        if layout in self._truth:
            return self._truth[layout]
        est = self.estimator(layout)
        truth = None
        if est.step_terms is not None and est.step_time_s and est.tokens_per_s:
            rng = self._draw("layout", layout.short())
            factors: dict[str, float] = {}

            def factor(term: str) -> float:
                if term not in factors:
                    factors[term] = math.exp(rng.gauss(0.0, TERM_SIGMA))
                return self.level * factors[term]

            terms = est.step_terms
            spread = math.sqrt(max(0.0, LAYOUT_SIGMA**2 - TERM_SIGMA**2 * sum(w * w for w in term_shares(terms))))
            step = terms.seconds(factor) * math.exp(rng.gauss(0.0, spread))
            sigma = math.log1p(self.cfg.estimate.memory_under_prediction)
            peak = est.memory_gib * math.exp(self._draw("memory", layout.short()).gauss(0.0, sigma))
            tokens = est.tokens_per_s * est.step_time_s / step
            flops = tokens * self._flops_per_token / layout.world_size
            truth = Truth(peak, step, tokens, flops / 1e12)
        self._truth[layout] = truth
        return truth

    def run_trial(self, cfg: SweepConfig, layout: Layout, trial_dir: Path, *, reservation: Reservation,
                  inject: str | None = None, cancel: threading.Event | None = None,
                  steps: int | None = None, reference: str | None = None,
                  make_reference: bool = False, routing_stress: bool = False) -> TrialResult:
        t = cfg.training
        steps = t.steps if steps is None else steps
        limit = t.trial_timeout_s * max(1.0, steps / t.steps)  # a confirmation's longer run: as TrialHost scales it
        with self._cond:
            start = self._starting.pop(id(reservation), self._clock)
            n = self.ledger.runs = self.ledger.runs + 1
            io_sharers = len(self._ends) + 1  # the trials running now, this one included
        nodes = len(set(reservation.node_ids))
        result, run = self._model(cfg, layout, steps, n, nodes, make_reference, limit=limit, start=start,
                                  io_sharers=io_sharers)
        duration = run.duration()
        if make_reference and result.passed:
            self._write_reference(cfg, layout, Path(reference or trial_dir))
            self._reference_bytes = checkpoint_bytes(cfg, layout.precision)
        own = checkpoint_bytes(cfg, layout.precision) if t.checkpoint and not make_reference else 0
        with self._cond:
            self.ledger.log.append(run)
            self._ends[id(reservation)] = start + duration
            running = len(self._ends)
            self._disk[id(reservation)] = own
            self.ledger.peak_trials = max(self.ledger.peak_trials, running)
            self._note_disk()
            if threading.current_thread() is threading.main_thread():
                # The driver itself waits on this run (the reference, before any trial): its time passes now.
                self._clock = max(self._clock, start + duration)
            self._cond.notify_all()
            while self._clock < start + duration and not (cancel is not None and cancel.is_set()):
                self._cond.wait(0.05)
            self.ledger.gpu_s += duration * layout.world_size
            if result.passed and t.keep_checkpoints != "none":
                self.ledger.kept_bytes += own  # a trial keeps its checkpoint until the sweep ends (or for good)
                self._disk[id(reservation)] = 0
                self._note_disk()
        result.timings_s["rehearsal_virtual_start_s"] = round(start, 1)
        result.timings_s["rehearsal_virtual_duration_s"] = round(duration, 1)
        result.rank_nodes = [label for label in reservation.labels for _ in range(reservation.gpus_per_bundle)]
        result.notes.append(f"{NOTE} (on {nodes} node(s))")
        return result

    def _note_disk(self) -> None:
        """The peak disk: the reference, the running trials' checkpoints and those the ended ones keep."""
        self.ledger.peak_disk_bytes = max(self.ledger.peak_disk_bytes, self._reference_bytes + self.ledger.kept_bytes
                                          + sum(self._disk.values()))

    def start_up_s(self, layout: Layout) -> float:
        """Seconds before a trial's model is built: ranks started, the rendezvous and NCCL process groups made."""
        return START_S + START_S_PER_RANK * layout.world_size

    def io_s(self, cfg: SweepConfig, layout: Layout, nodes: int, io_sharers: int, make_reference: bool) -> float:
        """The trial's shared-filesystem I/O: the reference read by the gate (the reference's run reads none), its
        own checkpoint written and read back; at its nodes' bandwidth or its share of the filesystem's."""
        # The reference's weights once its run wrote them; before (a trial modelled alone), the space's first
        # precision's, as a GPU cluster's reference is made (trial.reference.reference_layout).
        reference = self._reference_bytes or checkpoint_bytes(cfg, str(cfg.space.values("precision")[0]))
        reads = 0 if make_reference else reference
        own = 2 * checkpoint_bytes(cfg, layout.precision) if cfg.training.checkpoint else 0
        gb_s = min(max(1, nodes) * FS_GB_S, FS_SHARED_GB_S / max(1, io_sharers))
        return (reads + own) / (gb_s * 1e9)

    def _model(self, cfg: SweepConfig, layout: Layout, steps: int, n: int, nodes: int, make_reference: bool, *,
               limit: float | None = None, start: float = 0.0, io_sharers: int = 1) -> tuple[TrialResult, Run]:
        """The trial's result and its run on the virtual clock (``n``: the run's number, its noise's seed;
        ``nodes``: how many nodes it holds, each of which may be lost; ``limit``: its timeout, else the config's;
        ``io_sharers``: the trials doing I/O at once, this one included)."""
        limit = cfg.training.trial_timeout_s if limit is None else limit
        truth = self.truth(layout)
        rng = self._draw("run", layout.short(), n)
        begin = self.start_up_s(layout)
        gpus = layout.world_size
        if truth is None:
            return TrialResult(status="failed", failure_kind="unsupported", backend=BACKEND,
                               error="the estimator cannot price this layout's step"), Run(start, begin, 0.0, gpus,
                                                                                           limit)
        gpu = cfg.cluster.gpu_memory_gib
        if truth.peak_memory_gib > gpu:
            error = f"modelled peak {truth.peak_memory_gib:.1f} GiB > the GPU's {gpu:g} GiB"
            run = Run(start, begin + BUILD_S, truth.step_time_s, gpus, limit)
            return self._timed_out(run, limit) or TrialResult(
                status="failed", failure_kind="oom", error=error, backend=BACKEND, memory_kind="device"), run
        step = truth.step_time_s * math.exp(rng.gauss(0.0, RUN_SIGMA))
        fixed = begin + BUILD_S + self.io_s(cfg, layout, nodes, io_sharers, make_reference)
        run = Run(start, fixed, (GATE_STEPS + steps) * step, gpus, limit)
        held = min(run.duration(), limit)
        if rng.random() < 1.0 - math.exp(-self.faults.node_loss_per_hour * nodes * held / 3600):
            lost = Run(start, fixed, run.step_s, gpus, limit, fraction=held * rng.random() / (fixed + run.step_s))
            return TrialResult(status="failed", failure_kind="infra", backend=BACKEND, notes=["node_lost"],
                               error="a node of the trial was lost (modelled fault)"), lost
        if not make_reference and rng.random() < self.faults.hang:
            return TrialResult(status="failed", failure_kind="timeout", backend=BACKEND,
                               error=f"no step ended within {limit:g} s (modelled hang)"), Run(
                start, fixed, run.step_s, gpus, limit, hung=True)
        timed_out = self._timed_out(run, limit)
        if timed_out is not None:
            return timed_out, run
        rate = truth.step_time_s / step
        metrics = TrialMetrics(tokens_per_s=truth.tokens_per_s * rate, step_time_s=step,
                               tflops_per_gpu=truth.tflops_per_gpu * rate, peak_memory_gib=truth.peak_memory_gib,
                               pre_steps_peak_memory_gib=truth.peak_memory_gib)
        checks = TrialChecks(process_group=True, model_built=True, forward_backward=True, finite=True,
                             checkpoint_saved=cfg.training.checkpoint,
                             checkpoint_reloaded=True if cfg.training.checkpoint else None,
                             equivalence_rel_err=None if make_reference else 0.0, replicas_consistent=True)
        result = TrialResult(status="passed", metrics=metrics, checks=checks, backend=BACKEND, memory_kind="device",
                             step_times_s=[step] * steps, timings_s={"steps": steps * step})
        return result, run

    @staticmethod
    def _timed_out(run: Run, limit: float) -> TrialResult | None:
        """A run longer than the trial's timeout fails as a real one does: ``timeout``, at the limit."""
        if run.fixed_s + run.step_s <= limit:
            return None
        return TrialResult(status="failed", failure_kind="timeout", backend=BACKEND,
                           error=f"timeout: the modelled trial takes {run.fixed_s + run.step_s:,.0f} s, more than "
                                 f"{limit:g} s (training.trial_timeout_s)")

    def _write_reference(self, cfg: SweepConfig, layout: Layout, folder: Path) -> None:
        """The reference's record, as a real reference run writes it last (no weights: nothing loads them)."""
        folder.mkdir(parents=True, exist_ok=True)
        record = {"rehearsal": True, "model": cfg.model.model_dump(), "seq_length": cfg.training.seq_length,
                  "sequences": reference_sequences(cfg), "prefixes": {}, "layout": layout.to_dict(),
                  "precision": layout.precision}
        write_atomic(folder / REFERENCE_FILE, json.dumps(record) + "\n")

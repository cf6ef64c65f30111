"""The Optuna side of a sweep: a resumable study whose trials are Layouts, proposing only launchable ones.

Define-by-run over the space's axes (one categorical per axis), journal storage in the sweep folder. The study
is given the sweep's candidates (the layouts the rules accept, the estimator predicts fit, and the backend can
run) and every proposal it hands out is a candidate not yet decided or running: the space is enumerable, so
there is no reason to let a sampler spend asks on the rest. How the next candidate is picked:
  ordered - the next one in the given order (``sampler: grid``: the space's grid order; a space the budget
            covers: the sweep's packing order)
  random  - uniformly among the remaining candidates
  ranked  - the one a ``Chooser`` names among the remaining candidates (``sampler: auto``'s default, issue 54:
            ``search.propose.ranked``, the calibrated estimator's order with a share of exploration); the trial's
            user attribute ``proposed_by`` says why it was chosen
  tpe     - multivariate TPE with the constant liar over the axes; a draw that is not a remaining candidate is
            told to Optuna (see ``_decline``) and replaced by the nearest remaining candidate, so each proposal
            costs at most two asks
Layouts queued with ``enqueue`` (seeds, trials a dead driver left running, the estimator's favourites) come
first, as given, and may be refused by the sweep. Outcomes are told with Optuna's constraint mechanism: a
refused layout or a trial that ran out of memory is infeasible, so TPE learns that region instead of ignoring
those trials as FAIL.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from optuna.trial import TrialState

from sweeper.config.schema import SweepConfig
from sweeper.plan.space import pipeline_layout_values
from sweeper.space.axes import AXIS, SEARCHED
from sweeper.space.layout import Layout, resolve_sp
from sweeper.space.pipeline import with_pipeline_split

AXES: tuple[str, ...] = tuple(a.name for a in SEARCHED)  # one Optuna parameter per searched axis
# Its name: the axis's Megatron name, the one its MLflow parameter has (tracking.py), so that optuna-dashboard and
# the MLflow UI speak one vocabulary (tensor_model_parallel_size, not tp).
PARAM: dict[str, str] = {axis: AXIS[axis].param for axis in AXES}
PARAMS: frozenset[str] = frozenset(PARAM.values())
# Optuna >= 5 constraint (Trial.set_constraint): > 0 infeasible (rule, predicted or measured OOM), <= 0 feasible.
CONSTRAINT = "infeasible"
# A ranked proposal's user attribute: why the chooser named it (search.propose.ranked: "order" or "exploration").
PROPOSED_BY = "proposed_by"
Mode = Literal["ordered", "random", "ranked", "tpe"]
# A ranked study's choice: (the remaining candidates, in the study's order; how many ranked choices the study made
# before, a resumed one's included) -> (the layout, why it was chosen).
Chooser = Callable[[Sequence[Layout], int], tuple[Layout, str]]


@dataclass
class Proposal:
    trial: optuna.trial.Trial
    layout: Layout


@dataclass
class AskCounts:
    """What the proposals cost: Optuna asks, and the TPE draws declined (not a candidate / already taken)."""

    asks: int = 0
    infeasible: int = 0
    duplicates: int = 0


class LayoutStudy:
    def __init__(self, cfg: SweepConfig, journal: Path, mode: Mode, seed: int, candidates: Sequence[Layout],
                 chooser: Chooser | None = None) -> None:
        if (mode == "ranked") != (chooser is not None):
            raise ValueError(f"a chooser is what a ranked study proposes by, and only a ranked one (mode {mode!r})")
        self.cfg = cfg
        self.mode = mode
        self.chooser = chooser
        storage = JournalStorage(_journal_backend(journal))
        if mode == "tpe":
            sampler: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(
                seed=seed, multivariate=True, group=True, constant_liar=True, n_startup_trials=5
            )
        else:
            # Every ordered, random or ranked proposal is an enqueued trial with all its params fixed, so the sampler is
            # never asked for a value; RandomSampler is the inert placeholder Optuna requires.
            sampler = optuna.samplers.RandomSampler(seed=seed)
        self.study = optuna.create_study(
            study_name=cfg.name, storage=storage, sampler=sampler, direction="maximize", load_if_exists=True
        )
        self.study.set_metric_names([cfg.search.objective])  # optuna-dashboard's name for the value, as in MLflow
        self.choices = _choices(cfg)
        self.rng = random.Random(seed)
        self.counts = AskCounts()
        self._coords: dict[Layout, tuple[int, ...]] = {}  # each candidate's indices along the axes' value lists
        self.candidates: list[Layout] = []
        self.set_candidates(candidates)
        # Layouts outside the candidates already told infeasible (a resumed study keeps what it learned).
        self.told_infeasible = {
            self.layout_of(t.params) for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if set(t.params) == PARAMS and t.constraints.get(CONSTRAINT, 0.0) > 0
        }

    def set_candidates(self, candidates: Sequence[Layout]) -> None:
        """The layouts proposals are drawn from, in the order ``ordered`` mode visits them."""
        unique = list(dict.fromkeys(candidates))
        if unique == self.candidates:  # the same layouts in the same order (an event that re-ranked nothing)
            return
        self.candidates = unique
        known = self._coords  # a layout's coordinates never change; the candidates are set again on every event
        self._coords = {lo: self._coordinates(lo) if (kept := known.get(lo)) is None else kept for lo in unique}

    # -- layouts <-> Optuna params ---------------------------------------------------------------------------------
    def params_of(self, layout: Layout) -> dict[str, Any]:
        values = {axis: AXIS[axis].value(layout) for axis in AXES}
        if "auto" in self.choices["sp"] and layout.sp == resolve_sp("auto", layout.tp):
            values["sp"] = "auto"
        return {PARAM[axis]: value for axis, value in values.items()}

    def layout_of(self, params: dict[str, Any]) -> Layout:
        axes = {AXIS[axis].field: params[PARAM[axis]] for axis in AXES}
        axes["sp"] = resolve_sp(axes["sp"], axes["tp"])
        layout = Layout(gbs=self.cfg.trial_global_batch(axes["world_size"]), **axes)
        return with_pipeline_split(layout, self.cfg.model)

    def enqueue(self, layout: Layout, again: bool = False) -> None:
        """Queue a layout to be proposed next; ``again`` also when the study already holds it (a re-run)."""
        self.study.enqueue_trial(self.params_of(layout), skip_if_exists=not again)

    # -- ask / tell ------------------------------------------------------------------------------------------------
    def propose(self, taken: Callable[[Layout], bool]) -> Proposal | None:
        """The next layout to launch, never one ``taken`` (decided or running); None when no candidate is left.

        Queued layouts come first, as given (the sweep refuses and records one that is not launchable). Then
        one candidate per the mode; a TPE draw costs one extra ask at most, so asks stay bounded by proposals."""
        while self.has_queued():
            proposal = self._ask()
            if not taken(proposal.layout):
                return proposal
            self._decline(proposal, duplicate=True)
        left = [lo for lo in self.candidates if not taken(lo)]
        if not left:
            return None
        if self.mode == "tpe":
            proposal = self._ask()
            if proposal.layout in self._coords and not taken(proposal.layout):
                return proposal
            self._decline(proposal, duplicate=proposal.layout in self._coords or taken(proposal.layout))
            target = self._nearest(proposal.layout, left)
        elif self.mode == "random":
            target = self.rng.choice(left)
        elif self.chooser is not None:
            target, why = self.chooser(left, self._ranked_turns())
            self.study.enqueue_trial(self.params_of(target))
            proposal = self._ask()
            proposal.trial.set_user_attr(PROPOSED_BY, why)
            return proposal
        else:
            target = left[0]
        self.study.enqueue_trial(self.params_of(target))
        return self._ask()

    def tell(self, trial: optuna.trial.Trial, value: float | None, infeasible: bool) -> None:
        """value None = the attempt said nothing about the layout (infra failure): the Optuna trial is FAIL."""
        trial.set_constraint(CONSTRAINT, 1.0 if infeasible else 0.0)
        if value is None:
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            self.study.tell(trial, value)

    def has_queued(self) -> bool:
        """Whether enqueued layouts are still waiting to be proposed."""
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def take_over_running(self, recorded: Callable[[dict[str, Any]], tuple[float | None, bool] | None],
                          ) -> list[tuple[Layout, dict[str, Any]]]:
        """Trials a dead driver left RUNNING. One whose outcome was recorded before the driver died (``recorded``
        of its user attrs: (value, infeasible) as ``tell`` takes them) is told it; the others are FAILed and
        returned as (layout, user attrs), so the sweep re-runs them as new attempts of the same sweeper trial."""
        out = []
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.study.tell(trial.number, state=TrialState.FAIL)
            outcome = recorded(dict(trial.user_attrs))
            if outcome is not None:  # told as it would have been, in a trial of its own (the running one is FAIL)
                value, infeasible = outcome
                if value is not None:
                    self.study.add_trial(optuna.trial.create_trial(
                        value=value, params=trial.params, distributions=trial.distributions,
                        user_attrs=trial.user_attrs, constraints={CONSTRAINT: 1.0 if infeasible else 0.0}))
            elif set(trial.params) == PARAMS:
                out.append((self.layout_of(trial.params), dict(trial.user_attrs)))
        return out

    # -- internals -------------------------------------------------------------------------------------------------
    def _ranked_turns(self) -> int:
        """Ranked choices made so far, by this driver or one before it (the journal keeps their ``proposed_by``)."""
        return sum(1 for t in self.study.get_trials(deepcopy=False) if PROPOSED_BY in t.user_attrs)

    def _ask(self) -> Proposal:
        trial = self.study.ask()
        self.counts.asks += 1
        params = {PARAM[axis]: trial.suggest_categorical(PARAM[axis], self.choices[axis]) for axis in AXES}
        return Proposal(trial, self.layout_of(params))

    def _decline(self, proposal: Proposal, duplicate: bool) -> None:
        """Tell Optuna about a draw the sweep will not run.

        What Optuna 5's TPE (samplers/_tpe/sampler.py) does with each state decides this. It models only
        COMPLETE and PRUNED trials (plus RUNNING ones under the constant liar); ``_split_trials`` ranks a trial
        with a positive constraint after every feasible one, and an empty PRUNED trial (no intermediate values,
        score (1, 0.0)) after every COMPLETE one, so both land in the "above" (bad) density. FAIL trials are
        not read at all, nor counted towards ``n_startup_trials``.
          - A duplicate (its layout was already decided, or is running) is FAIL: it tells TPE nothing. PRUNED,
            as before, put a bad-density kernel on a good layout each time TPE re-proposed it; COMPLETE with
            the recorded value would weight that layout twice in the good density, drawing TPE back to it (and
            while the first trial runs there is no value to copy; the liar already covers it).
          - A layout outside the candidates (a rule rejects it, it is predicted over the memory budget, or the
            backend cannot run it) is told infeasible once, COMPLETE with a positive constraint: a true
            statement about that region, which steers later draws away from it. A repeat is FAIL, like a
            duplicate, so one infeasible layout never weighs more than once."""
        layout = proposal.layout
        if duplicate or layout in self.told_infeasible:
            self.counts.duplicates += 1
            proposal.trial.set_user_attr("declined", "duplicate")
            self.study.tell(proposal.trial, state=TrialState.FAIL)
            return
        self.counts.infeasible += 1
        self.told_infeasible.add(layout)
        proposal.trial.set_user_attr("declined", "not launchable (see `sweeper plan` for the reason)")
        self.tell(proposal.trial, 0.0, infeasible=True)

    def _coordinates(self, layout: Layout) -> tuple[int, ...]:
        params = self.params_of(layout)
        values = [(axis, params[PARAM[axis]]) for axis in AXES]
        return tuple(self.choices[axis].index(v) if v in self.choices[axis] else -1 for axis, v in values)

    def _nearest(self, layout: Layout, left: list[Layout]) -> Layout:
        """The remaining candidate closest to a declined draw: fewest axes changed, then the smallest steps along
        the axes' value lists; ties broken at random (seeded), so TPE's direction is kept, not a fixed order."""
        here = self._coordinates(layout)

        def distance(candidate: Layout) -> tuple[int, int]:
            there = self._coords[candidate]
            changed = [abs(a - b) for a, b in zip(here, there) if a != b]
            return len(changed), sum(changed)

        scored = [(distance(lo), lo) for lo in left]
        best = min(d for d, _ in scored)
        return self.rng.choice([lo for d, lo in scored if d == best])


# Seconds a journal lock may stand unchanged before it is taken as a dead driver's: a live one holds it for the
# milliseconds of one append.
JOURNAL_LOCK_GRACE_S = 5


def _journal_backend(journal: Path) -> JournalFileBackend:
    """The journal file and its lock, by absolute path. A driver killed while appending leaves its lock file behind;
    Optuna takes it as stale after ``JOURNAL_LOCK_GRACE_S``. The lock is an O_EXCL file, not Optuna's default
    symlink: that symlink points at the journal by the path it was given, so a relative one dangles, and a dangling
    lock is never found stale (a resumed driver spun on it for good; scripts/kill_resume.py caught it)."""
    path = str(Path(journal).resolve())
    return JournalFileBackend(path, lock_obj=JournalFileOpenLock(path, grace_period=JOURNAL_LOCK_GRACE_S))


def _choices(cfg: SweepConfig) -> dict[str, list[Any]]:
    choices = {axis: cfg.space.values(axis) for axis in AXES if axis != "gpus"}
    choices["sp"] = list(dict.fromkeys(choices["sp"]))  # auto and true may be the same layouts
    choices["pipeline_layout"] = pipeline_layout_values(cfg)  # a layout holds its string (auto's generated ones)
    return {"gpus": cfg.world_sizes, **choices}

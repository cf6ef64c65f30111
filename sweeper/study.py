"""The Optuna side of a sweep: a resumable study whose trials are Layouts.

Define-by-run over the space's axes (one categorical per axis), journal storage in the sweep folder, and
Optuna's constraint mechanism for what must never be launched or did not fit: a layout the rules reject, one
the estimator predicts over the memory budget, or a trial that ran out of memory is told with a positive
constraint value, so TPE learns the infeasible region instead of ignoring those trials as FAIL. Small spaces
are covered exhaustively (every launchable layout enqueued, fastest predicted first); large ones use a
multivariate TPE with the constant liar so that concurrent proposals spread out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from sweeper.config import SweepConfig
from sweeper.layout import Layout
from sweeper.rules import with_pipeline_split

AXES = ("gpus", "tp", "pp", "vpp", "cp", "ep", "etp", "sp", "mbs", "precision", "recompute", "distributed_optimizer")
# Optuna >= 5 constraint (Trial.set_constraint): > 0 infeasible (rule, predicted or measured OOM), <= 0 feasible.
CONSTRAINT = "infeasible"


@dataclass
class Proposal:
    trial: optuna.trial.Trial
    layout: Layout


class LayoutStudy:
    def __init__(self, cfg: SweepConfig, journal: Path, exhaustive: bool, seed: int) -> None:
        self.cfg = cfg
        storage = JournalStorage(JournalFileBackend(str(journal)))
        if exhaustive or cfg.search.sampler == "grid":
            # The candidates are enqueued in order; a sampler is only consulted once the queue is empty.
            sampler: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=seed)
        elif cfg.search.sampler == "random":
            sampler = optuna.samplers.RandomSampler(seed=seed)
        else:
            sampler = optuna.samplers.TPESampler(
                seed=seed, multivariate=True, group=True, constant_liar=True, n_startup_trials=5
            )
        self.study = optuna.create_study(
            study_name=cfg.name, storage=storage, sampler=sampler, direction="maximize", load_if_exists=True
        )
        self.choices = _choices(cfg)

    # -- layouts <-> Optuna params ---------------------------------------------------------------------------------
    def params_of(self, layout: Layout) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for axis in AXES:
            if axis == "sp":
                params["sp"] = "auto" if "auto" in self.choices["sp"] and layout.sp == (layout.tp > 1) else layout.sp
            elif axis == "gpus":
                params["gpus"] = layout.world_size
            else:
                params[axis] = getattr(layout, axis)
        return params

    def layout_of(self, params: dict[str, Any]) -> Layout:
        sp = params["sp"]
        layout = Layout(
            world_size=params["gpus"], tp=params["tp"], pp=params["pp"], vpp=params["vpp"], cp=params["cp"],
            ep=params["ep"], etp=params["etp"], sp=(params["tp"] > 1) if sp == "auto" else bool(sp),
            mbs=params["mbs"], gbs=self.cfg.training.global_batch_size, precision=params["precision"],
            recompute=params["recompute"], distributed_optimizer=params["distributed_optimizer"],
        )
        return with_pipeline_split(layout, self.cfg.model)

    def enqueue(self, layout: Layout, again: bool = False) -> None:
        """Queue a layout to be proposed next; ``again`` also when the study already holds it (a re-run)."""
        self.study.enqueue_trial(self.params_of(layout), skip_if_exists=not again)

    # -- ask / tell ------------------------------------------------------------------------------------------------
    def ask(self) -> Proposal:
        trial = self.study.ask()
        params = {axis: trial.suggest_categorical(axis, self.choices[axis]) for axis in AXES}
        return Proposal(trial, self.layout_of(params))

    def tell(self, trial: optuna.trial.Trial, value: float | None, infeasible: bool) -> None:
        """value None = the attempt said nothing about the layout (infra failure): the Optuna trial is FAIL."""
        trial.set_constraint(CONSTRAINT, 1.0 if infeasible else 0.0)
        if value is None:
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            self.study.tell(trial, value)

    def skip(self, trial: optuna.trial.Trial) -> None:
        """A proposal sweeper will not run (already decided or running): PRUNED, so it is never launched twice."""
        self.study.tell(trial, state=TrialState.PRUNED)

    def has_queued(self) -> bool:
        """Whether enqueued layouts are still waiting to be proposed."""
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def take_over_running(self) -> list[tuple[Layout, dict[str, Any]]]:
        """Trials a dead driver left RUNNING: FAIL them in Optuna and return (layout, user attrs) of each, so the
        sweep re-runs them as new attempts of the same sweeper trial."""
        out = []
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if set(trial.params) == set(AXES):
                out.append((self.layout_of(trial.params), dict(trial.user_attrs)))
            self.study.tell(trial.number, state=TrialState.FAIL)
        return out


def _choices(cfg: SweepConfig) -> dict[str, list[Any]]:
    s = cfg.space
    return {
        "gpus": cfg.world_sizes, "tp": s.tp, "pp": s.pp, "vpp": s.vpp, "cp": s.cp, "ep": s.ep, "etp": s.etp,
        "sp": list(dict.fromkeys(s.sp)), "mbs": s.mbs, "precision": s.precision, "recompute": s.recompute,
        "distributed_optimizer": s.distributed_optimizer,
    }

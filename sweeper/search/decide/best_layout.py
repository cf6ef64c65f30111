"""best_layout.yaml: the winner in the forms a user pastes into a pretraining launch, with the runs that chose it."""

from __future__ import annotations

import statistics
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.export.bridge import dotted_overrides
from sweeper.export.megatron_lm import layout_args
from sweeper.models.proxy import PROXY_NOTE, is_proxy
from sweeper.record.schema import MODELLED, REHEARSAL_NOTE
from sweeper.search.decide.candidates import Candidate, run_gpus
from sweeper.search.decide.objective import PROJECTED_STEP_ERROR, copies, objective_name, production_gpus, projection
from sweeper.search.decide.verdicts import stall_ratio, step_time_drift
from sweeper.space.layout import Layout


def checkpoint_moves(cands: list[Candidate]) -> dict[str, Any]:
    """The stable layouts a checkpoint of this model is proven to move into: each loaded the sweep's reference
    checkpoint (torch_dist, written by the reference layout) resharded into its own layout and computed the
    reference's loss and gradient norm on the reference batch (issue 17)."""
    proven = [c for c in cands if c.explore.result.checks.equivalence_rel_err is not None]
    writers = sorted({str(c.explore.result.reference_load["from_layout"]) for c in proven
                      if c.explore.result.reference_load})
    return {
        "layouts": [c.layout.short() for c in proven],
        "written_by": writers,
        "note": ("a torch_dist checkpoint of the model's weights loads into each of these layouts (resharded) and "
                 "computes the same loss; `sweeper migrate SPACE --from LAYOUT --to LAYOUT` proves one move with "
                 "your own layouts, steps and save included"),
    }


def best_layout_document(cfg: SweepConfig, winner: Candidate, mlflow_uri: str | None,
                         cands: list[Candidate] | None = None, rehearsal: bool = False) -> dict[str, Any]:
    """``rehearsal``: the runs were modelled (a rehearsal): the document says so at its top, and its "measured"
    figures are the modelled runs' (issue 54)."""
    chosen_by = winner.figure_run(cfg)  # the run whose figure chose the winner: its run at scale, else its median
    result = chosen_by.result
    layout = winner.layout
    measured_on = Layout.from_dict(chosen_by.layout)  # the trial's, or more GPUs at scale (issue 53)
    production = cfg.production_layout(layout) or layout  # what the exports launch (issue 43)
    step = result.metrics.step_time_s
    made = projection(cfg, measured_on, step, winner.calibration) if step else None
    return {
        "rehearsal": f"{MODELLED}: {REHEARSAL_NOTE}" if rehearsal else False,
        "name": cfg.name,
        "model": cfg.model.name,
        "proxy": PROXY_NOTE if is_proxy(cfg.model) else False,
        "trial": winner.number,
        "layout": layout.to_dict(),
        "layout_string": layout.to_string(),
        "production": {"gpus": production.world_size, "copies": copies(cfg, layout),
                       "layout_string": production.to_string(), "global_batch_size": production.gbs},
        "megatron_args": layout_args(cfg, production),
        "megatron_bridge_overrides": dotted_overrides(cfg, production),
        "run": {"framework": cfg.run.framework, **cfg.run.model_dump(exclude_defaults=True)},
        "measured": dict(vars(result.metrics)),
        "measured_run": {"phase": chosen_by.phase, "attempt": chosen_by.attempt},
        "measured_median_over_runs": {
            cfg.search.objective: statistics.median(winner.measured(cfg.search.objective)),
            "runs": len(winner.trial_runs),
        },
        "objective": {
            "name": objective_name(cfg),
            "production_gpus": production_gpus(cfg),
            "copies": copies(cfg, layout),
            "median": winner.median(cfg),  # over its runs on the trial's GPUs, each projected
            "figure": winner.figure(cfg),  # what chose it: its run at scale where it has one, else the median
            # How much of the figure's production step is the estimator's, not measured (issue 53): none when the
            # winner ran as the production run (search.confirm_at_scale)
            "measured_on_gpus": measured_on.world_size,
            "at_scale": None if winner.at_scale is None else {
                "gpus": measured_on.world_size, "layout_string": measured_on.to_string(),
                "attempt": chosen_by.attempt, "global_batch_size": measured_on.gbs},
            "projected_share": made.projected_share if made else None,
            "projected_step_s": made.projected_step_s if made else None,
            "projected_error": PROJECTED_STEP_ERROR,
            "runs": [{"phase": r.phase, "attempt": r.attempt, "gpus": run_gpus(r),
                      "projected": v,
                      "measured": getattr(r.result.metrics, cfg.search.objective)}
                     for r, v in zip(winner.runs, winner.values(cfg), strict=True)],
        },
        "confirmation": {
            "runs": len(winner.confirmations),
            # every confirmation attempt, those lost to faults that were not the layout's included (issue 51)
            "attempts": [{"attempt": r.attempt, "status": r.result.status, "failure_kind": r.result.failure_kind,
                          "error": r.result.error} for r in winner.attempts],
            "steps": [len(r.result.step_times_s) for r in winner.confirmations],
            "step_time_drift": [step_time_drift(r.result, cfg.training.warmup_steps) for r in winner.confirmations],
            "max_step_time_drift": cfg.search.confirm_max_step_time_drift,
            "step_time_p90_over_median": [stall_ratio(r.result) for r in winner.confirmations],
            "max_step_time_p90": cfg.search.confirm_max_step_time_p90,
        },
        "memory": {
            "predicted_gib": winner.explore.predicted_memory_gib,
            "measured_gib": result.metrics.peak_memory_gib,
            "measured_kind": "host RSS (CPU backend)" if result.memory_kind == "host" else "device reserved",
            "gpu_memory_gib": cfg.cluster.gpu_memory_gib,
            "headroom": cfg.search.memory_headroom,
        },
        "checkpoint_moves_to": checkpoint_moves(cands if cands is not None else [winner]),
        "backend": result.backend,
        "mlflow": {
            "tracking_uri": mlflow_uri,
            "run_id": winner.explore.mlflow_run_id,
            "confirmation_run_ids": [r.mlflow_run_id for r in winner.confirmations],
        },
    }

"""`sweeper migrate` (issue 17, item 5): bad input and incompatible pairs refused before anything starts, then a
real move between two CPU layouts of the quickstart model on the simulated cluster (real megatron-core)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sweeper.cli import main

QUICKSTART = Path(__file__).parents[2] / "search_spaces" / "quickstart.yaml"


def _migrate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict | None, str]:
    code = main(["migrate", str(QUICKSTART), "--json", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_a_layout_string_that_is_not_one_exits_2_naming_the_option(capsys, tmp_path: Path) -> None:
    code, out, err = _migrate(capsys, "--from", "tp=2", "--to", "tq=2", "--out", str(tmp_path / "m"))
    assert code == 2 and out is None and err.startswith("error: --to: ") and "tq" in err
    assert not (tmp_path / "m").exists()


def test_a_layout_the_rules_reject_fails_before_anything_starts(capsys, tmp_path: Path) -> None:
    code, out, _ = _migrate(capsys, "--from", "gpus=2,pp=2", "--to", "gpus=3,ep=3", "--out", str(tmp_path / "m"))
    assert code == 1 and out is not None
    assert (out["status"], out["failure_kind"]) == ("failed", "invalid_layout")
    assert out["error"].startswith("--to TP1-PP1-EP3-DP3") and "3" in out["error"]
    assert out["to_result"] is None and not (tmp_path / "m").exists()


def test_a_checkpoint_sweeper_did_not_write_is_bad_input(capsys, tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    code, out, err = _migrate(capsys, "--from", "gpus=2,pp=2", "--to", "gpus=2,ep=2",
                              "--checkpoint", str(tmp_path / "ckpt"))
    assert code == 2 and out is None and "no reference.json in it" in err


def test_the_migrations_runs_keep_their_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 43: whatever training.keep_checkpoints says, neither run deletes a checkpoint. The host is a STAND-IN
    # (no Ray, no Megatron) that records what each run is asked; the real move is the e2e test below.
    import contextlib

    from sweeper.config.load import load_config
    from sweeper.record.schema import TrialResult
    from sweeper.trial import migrate as migration
    from sweeper.trial.protocol import Reservation

    asked: list[str] = []

    class StandInHost:
        simulated, backend_name = True, "stand-in"

        def unsupported(self, model: object, layout: object) -> None:
            return None

        def reserve_within(self, layout: object, timeout_s: float) -> Reservation:
            return Reservation(["n0"], ["n0"], 2)

        def release(self, reservation: Reservation) -> None:
            pass

        def run_trial(self, cfg, layout, trial_dir, *, reservation, reference=None, make_reference=False,
                      **kw) -> TrialResult:
            asked.append(cfg.training.keep_checkpoints)
            if make_reference:  # the --from run writes the reference the --to run loads
                Path(reference).mkdir(parents=True)
                (Path(reference) / "reference.json").write_text("{}")
            return TrialResult(status="passed")

    monkeypatch.setattr(migration, "open_host", lambda cfg, address: contextlib.nullcontext(StandInHost()))
    cfg = load_config(QUICKSTART)
    assert cfg.training.keep_checkpoints == "none"
    source, target = migration.parse_layouts(cfg, "gpus=2,ep=2", "gpus=2,pp=2")
    migration.migrate(cfg, source, target, tmp_path / "m")
    assert asked == ["all", "all"]  # the --from run, then the --to run
    assert (tmp_path / "m" / "from" / "reference.json").is_file()


@pytest.mark.e2e
def test_migrate_moves_a_checkpoint_between_two_cpu_layouts_and_refuses_an_incompatible_pair(
        capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sweeper.backends.megatron")
    monkeypatch.chdir(tmp_path)  # MLflow-free command, but the default folders land here
    out_dir = tmp_path / "move"
    code, out, err = _migrate(capsys, "--from", "gpus=2,ep=2", "--to", "gpus=4,tp=2,ep=2", "--out", str(out_dir),
                              "--set", "training.steps=2", "--set", "training.warmup_steps=1")
    assert out is not None, err
    assert code == 0 and out["status"] == "passed", out["error"]
    assert out["from"]["ep"] == 2 and (out["to"]["tp"], out["to"]["ep"]) == (2, 2)
    assert out["written_by"] == "from run" and (out_dir / "from" / "reference.json").is_file()
    # EP2 wrote whole attention matrices; TP2 reads halves of them (the experts stay where EP2 put them).
    assert 0 < len(out["resharded"]) <= out["tensors"]
    assert any("linear_qkv" in key for key in out["resharded"])
    assert len(out["load_s_per_rank"]) == 4 and all(t is not None and t > 0 for t in out["load_s_per_rank"])
    assert 0 <= out["load_spread_s"] < out["nccl_timeout_s"] == 600.0
    assert out["equivalence_rel_err"] is not None and out["equivalence_rel_err"] <= 1e-3  # fp32 both sides
    assert out["steps_after_load"] == 2 and out["to_result"]["checks"]["checkpoint_reloaded"] is True
    assert "not moved" in out["optimizer_state"]
    assert out["to_result"]["reference_load"]["from_layout"].startswith("TP1-PP1-EP2")

    # The same checkpoint into a space of another model: refused before a cluster starts, with both models named.
    code, bad, _ = _migrate(capsys, "--from", "gpus=2,ep=2", "--to", "gpus=2,pp=2", "--checkpoint",
                            str(out_dir / "from"), "--out", str(tmp_path / "bad"), "--set", "model=tiny-gpt")
    assert code == 1 and bad is not None and (bad["status"], bad["failure_kind"]) == ("failed", "incompatible")
    assert "'tiny-moe'" in bad["error"] and "'tiny-gpt'" in bad["error"] and not (tmp_path / "bad").exists()

"""training.keep_checkpoints (issue 43): the setting, a trial checkpoint's deletion, and the sweep's pruning at its
end, on folder trees in tmp_path (the trials' deletion after their reload is tested with real ranks in
tests/backends/test_backend_megatron.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sweeper.config.schema import TrainingConfig
from sweeper.record.checkpoints import REFERENCE_FILE, checkpoint_folder, delete_checkpoint, folder_bytes
from sweeper.record.schema import TrialRecord, TrialResult
from sweeper.search.decide.checkpoints import prune_checkpoints


def _trial(root: Path, name: str, sizes: tuple[int, ...] = (1000, 24)) -> Path:
    """A trial folder with a rank log and a two-save checkpoint holding files of ``sizes`` bytes each."""
    trial = root / "trials" / name
    trial.mkdir(parents=True)
    (trial / "rank_0.log").write_text("log")
    for step in (2, 4):
        save = checkpoint_folder(trial) / f"iter_{step:07d}"
        save.mkdir(parents=True)
        for i, size in enumerate(sizes):
            (save / f"__{i}_0.distcp").write_bytes(b"x" * size)
    return trial


def _record(number: int, trial: Path | None, attempt: int = 1, phase: str = "explore") -> TrialRecord:
    result = TrialResult(status="passed", trial_dir=None if trial is None else str(trial))
    return TrialRecord(number=number, layout={}, result=result, attempt=attempt, phase=phase)  # type: ignore[arg-type]


def test_keep_checkpoints_defaults_to_none_and_takes_only_its_three_values() -> None:
    assert TrainingConfig().keep_checkpoints == "none"
    assert TrainingConfig(keep_checkpoints="winner").keep_checkpoints == "winner"
    with pytest.raises(ValidationError, match="keep_checkpoints"):
        TrainingConfig(keep_checkpoints="best")  # type: ignore[arg-type]


def test_folder_bytes_counts_every_save_and_an_absent_folder_is_zero(tmp_path: Path) -> None:
    trial = _trial(tmp_path, "0001-a1")
    assert folder_bytes(checkpoint_folder(trial)) == 2 * (1000 + 24)
    assert folder_bytes(tmp_path / "missing") == 0


def test_a_deleted_checkpoint_leaves_the_trial_folder_and_a_reference_is_never_deleted(tmp_path: Path) -> None:
    trial = _trial(tmp_path, "0001-a1")
    assert delete_checkpoint(checkpoint_folder(trial)) is None
    assert not checkpoint_folder(trial).exists() and (trial / "rank_0.log").is_file()
    assert delete_checkpoint(checkpoint_folder(trial)) is None  # already gone: nothing to say
    # A folder holding reference.json is a checkpoint the gate or `migrate` reads.
    reference = checkpoint_folder(_trial(tmp_path, "0002-a1"))
    (reference / "iter_0000004" / REFERENCE_FILE).write_text("{}")
    problem = delete_checkpoint(reference)
    assert problem is not None and "reference.json" in problem and reference.is_dir()


def test_a_deletion_that_fails_says_why_and_raises_nothing(tmp_path: Path) -> None:
    # A checkpoint folder that is a link to another tree: rmtree refuses it, and nothing behind it is touched.
    elsewhere = checkpoint_folder(_trial(tmp_path, "0001-a1"))
    trial = tmp_path / "trials" / "0002-a1"
    trial.mkdir()
    checkpoint_folder(trial).symlink_to(elsewhere, target_is_directory=True)
    problem = delete_checkpoint(checkpoint_folder(trial))
    assert problem is not None and problem.startswith(f"{checkpoint_folder(trial)} could not be deleted: ")
    assert "\n" not in problem and (elsewhere / "iter_0000002" / "__0_0.distcp").is_file()


def test_prune_keeps_the_winners_runs_and_deletes_the_rest(tmp_path: Path) -> None:
    winner_explore, winner_confirm = _trial(tmp_path, "0003-a1"), _trial(tmp_path, "0003-a1-confirm1")
    loser, failed_first = _trial(tmp_path, "0001-a1", sizes=(10,)), _trial(tmp_path, "0002-a1", sizes=(5, 5))
    deleted_by_trial = tmp_path / "trials" / "0004-a1"  # keep_checkpoints none: the trial deleted its own
    deleted_by_trial.mkdir(parents=True)
    records = [_record(1, loser), _record(2, failed_first), _record(2, _trial(tmp_path, "0002-a2"), attempt=2),
               _record(3, winner_explore), _record(3, winner_confirm, phase="confirm"), _record(4, deleted_by_trial),
               _record(5, None)]  # refused before launch: no trial folder

    pruned = prune_checkpoints(records, "winner", winner_number=3)

    assert sorted(Path(p).parent.name for p in pruned.kept) == ["0003-a1", "0003-a1-confirm1"]
    assert sorted(Path(p).parent.name for p in pruned.deleted) == ["0001-a1", "0002-a1", "0002-a2"]
    assert pruned.freed_bytes == 2 * 10 + 2 * 10 + 2 * 1024 and pruned.failed == []
    assert checkpoint_folder(winner_explore).is_dir() and checkpoint_folder(winner_confirm).is_dir()
    assert not checkpoint_folder(loser).exists() and (loser / "rank_0.log").is_file()
    line = pruned.line()
    assert line is not None and "deleted 3 trial checkpoint(s)" in line and "keep_checkpoints: winner" in line
    assert pruned.to_json()["keep"] == "winner"


def test_prune_with_all_deletes_nothing_and_with_none_deletes_what_trials_left(tmp_path: Path) -> None:
    records = [_record(1, _trial(tmp_path, "0001-a1")), _record(2, _trial(tmp_path, "0002-a1"))]
    kept = prune_checkpoints(records, "all", winner_number=1)
    assert len(kept.kept) == 2 and kept.deleted == [] and kept.freed_bytes == 0 and kept.line() is None
    gone = prune_checkpoints(records, "none", winner_number=1)  # a winner does not keep its checkpoint under none
    assert len(gone.deleted) == 2 and gone.kept == [] and gone.freed_bytes == 2 * 2 * 1024
    assert not any(checkpoint_folder(r.result.trial_dir or "").exists() for r in records)


def test_prune_without_a_winner_deletes_every_checkpoint_and_never_the_reference(tmp_path: Path) -> None:
    trial = _trial(tmp_path, "0001-a1")
    reference = tmp_path / "reference"  # the sweep's equivalence reference: not a trial's checkpoint/ folder
    reference.mkdir()
    (reference / REFERENCE_FILE).write_text("{}")
    pruned = prune_checkpoints([_record(1, trial)], "winner", winner_number=None)
    assert len(pruned.deleted) == 1 and (reference / REFERENCE_FILE).is_file()

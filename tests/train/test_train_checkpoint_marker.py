"""Checkpoint completeness, run folders and config changes, on small folders without training (the same rules
run for real in tests/train/test_train_run_faults.py):
- ``complete.json`` is written last; resume (``latest`` / ``auto``) skips a newest tag with a file deleted or
  truncated or without its marker, with a warning, and lands on the newest complete one; a damaged tag named
  explicitly is refused by name; folders written before markers existed are trusted as before;
- a checkpoint write that fails for lack of space removes the partial tag, keeps ``latest`` and names the
  folder and its free space (a simulated ENOSPC; a real full filesystem is in the run-faults tests);
- a run folder holding a run is refused without ``--resume`` / ``run.overwrite``; its lock refuses a second
  holder;
- resuming with a changed batch size is refused by name, harmless and allowed fields pass."""
import errno
import os
import shutil

import pytest
import yaml

from mplug_pretrain.config import load_config
from mplug_pretrain.config_loader import to_dict
from mplug_pretrain.errors import ConfigError
from mplug_pretrain.train import checkpoint as ckpt
from mplug_pretrain.train.config_change import refused_changes
from mplug_pretrain.train.run_folder import RunFolderBusyError, RunFolderLock, claim_run_folder
from tests.helpers import REPO_ROOT

TINY = os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml")


def _complete_tag(folder, step, marked=True):
    tag_dir = folder / ckpt.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"m" * 100)
    (tag_dir / "trainer_state_rank0.pt").write_bytes(b"t" * 10)
    if marked:
        ckpt._write_marker(str(tag_dir), step, 1, "pretrain")
    ckpt._write_latest(str(folder), ckpt.tag_for(step))
    return tag_dir


DAMAGE = {
    "file deleted": lambda tag: os.remove(tag / "mp_rank_00_model_states.pt"),
    "file truncated": lambda tag: (tag / "mp_rank_00_model_states.pt").write_bytes(b"m" * 40),
    "marker missing": lambda tag: os.remove(tag / ckpt.COMPLETE),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_falls_back_from_a_damaged_newest_tag(tmp_path, damage):
    for step in (2, 4, 6):
        newest = _complete_tag(tmp_path, step)
    DAMAGE[damage](newest)
    for resume in ("latest", "auto"):
        tag, warnings = ckpt.resolve_resume(resume, str(tmp_path))
        assert tag == ckpt.tag_for(4)
        assert len(warnings) == 1 and ckpt.tag_for(6) in warnings[0] and "damaged" in warnings[0]
    with pytest.raises(ckpt.CheckpointError, match=ckpt.tag_for(6)):
        ckpt.resolve_resume(ckpt.tag_for(6), str(tmp_path))  # named explicitly: no silent substitute
    assert ckpt.resolve_resume(ckpt.tag_for(2), str(tmp_path)) == (ckpt.tag_for(2), [])


def test_no_complete_tag_left_is_an_error_naming_each(tmp_path):
    for step in (2, 4):
        os.remove(_complete_tag(tmp_path, step) / "trainer_state_rank0.pt")
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint") as err:
        ckpt.resolve_resume("latest", str(tmp_path))
    assert ckpt.tag_for(2) in str(err.value) and ckpt.tag_for(4) in str(err.value)


def test_tags_written_before_markers_are_trusted(tmp_path):
    _complete_tag(tmp_path, 2, marked=False)
    _complete_tag(tmp_path, 4, marked=False)
    assert ckpt.resolve_resume("latest", str(tmp_path)) == (ckpt.tag_for(4), [])
    _complete_tag(tmp_path, 6)  # the upgraded run's first marked tag: older unmarked tags stay usable
    assert ckpt.tag_problem(str(tmp_path), ckpt.tag_for(4)) is None


class _DiskFullEngine:
    """DeepSpeed's save as a full disk makes it end: part of a file written, then ENOSPC."""
    module = None

    def save_checkpoint(self, ckpt_dir, tag, save_latest):
        os.makedirs(os.path.join(ckpt_dir, tag), exist_ok=True)
        with open(os.path.join(ckpt_dir, tag, "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_removes_the_partial_tag_and_names_folder_and_free_space(tmp_path):
    _complete_tag(tmp_path, 2)
    state = ckpt.TrainerState(global_step=3)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.save_checkpoint(_DiskFullEngine(), str(tmp_path), state, rank=0, keep_last=2)
    message = str(err.value)
    free_mib = shutil.disk_usage(tmp_path).free / 2**20
    assert str(tmp_path) in message and "disk is full" in message and ckpt.tag_for(3) in message
    assert f"{free_mib:.0f}" in message or f"{free_mib:.1f}" in message  # the free space, in MiB
    assert not (tmp_path / ckpt.tag_for(3)).exists()
    assert ckpt.read_latest(str(tmp_path)) == ckpt.tag_for(2)
    assert ckpt.tag_problem(str(tmp_path), ckpt.tag_for(2)) is None


def test_run_folder_with_a_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    claim_run_folder(str(run_dir), None, overwrite=False).release()  # a fresh folder is fine
    _complete_tag(run_dir / "checkpoints", 2)
    (run_dir / "log.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="already holds a run.*--resume.*run.overwrite=true"):
        claim_run_folder(str(run_dir), None, overwrite=False)
    assert (run_dir / "checkpoints" / ckpt.tag_for(2) / ckpt.COMPLETE).is_file()  # untouched
    claim_run_folder(str(run_dir), "latest", overwrite=False).release()
    (run_dir / "notes.txt").write_text("mine")
    claim_run_folder(str(run_dir), None, overwrite=True).release()
    assert sorted(os.listdir(run_dir)) == [".lock", "notes.txt"]  # the old run's outputs only


def test_overwrite_removes_a_symlinked_output_folder_not_its_target(tmp_path, capsys):
    """Issue 37, item 5: a symlinked tensorboard/ once crashed rmtree after log.jsonl was deleted (half-cleared)."""
    run_dir = tmp_path / "run"
    _complete_tag(run_dir / "checkpoints", 2)
    (run_dir / "log.jsonl").write_text('{"step": 1}\n')
    shared = tmp_path / "shared_tensorboard"
    shared.mkdir()
    (shared / "events.other_run").write_text("another run's events")
    os.symlink(shared, run_dir / "tensorboard")
    claim_run_folder(str(run_dir), None, overwrite=True).release()
    assert sorted(os.listdir(run_dir)) == [".lock"]
    assert (shared / "events.other_run").read_text() == "another run's events"
    assert "symlinks removed, their targets kept: tensorboard" in capsys.readouterr().out


def test_run_folder_lock_refuses_a_second_holder(tmp_path):
    first = RunFolderLock(str(tmp_path))
    with pytest.raises(RunFolderBusyError, match=f"in use by another run \\(pid {os.getpid()}"):
        claim_run_folder(str(tmp_path), "auto", overwrite=False)
    first.release()
    claim_run_folder(str(tmp_path), "auto", overwrite=False).release()


def test_config_changes_refused_by_name_harmless_ones_pass():
    saved = yaml.safe_load(yaml.safe_dump(to_dict(load_config(TINY, check_paths=False))))
    changed = load_config(TINY, ["data.batch_size=4", "optim.grad_accum_steps=2", "run.log_every=1",
                                 "run.keep_last=5", "eval.batch_size=3", "model.grad_checkpointing=true"],
                          check_paths=False)
    assert [(name, old, new) for name, old, new in refused_changes(saved, changed)] == [
        ("data.batch_size", 16, 4), ("optim.grad_accum_steps", 1, 2)]
    allowed = load_config(TINY, ["data.batch_size=4", "run.allow_config_change=[data, optim.grad_accum_steps]",
                                 "optim.grad_accum_steps=2"], check_paths=False)
    assert refused_changes(saved, allowed) == []
    with pytest.raises(ConfigError, match="run.allow_config_change: 'optim.lr'"):
        load_config(TINY, ["run.allow_config_change=[optim.lr]"], check_paths=False)

"""``run.keep_last``: after a save, the checkpoints folder keeps the newest ``keep_last`` complete tags (the one
``latest`` names and those before it); older tags and tags newer than ``latest`` (half-written by an attempt
that was killed while saving) are removed, of those the run's ledger names only: a user's folder, a copied tag,
a symlink to another run's folder and every other file stay (issue 37, item 2)."""
import os

import pytest

from mplug_pretrain.train import checkpoint as ckpt
from mplug_pretrain.train.checkpoint import _prune, _record, _write_latest, _write_marker, tag_for


def _make_tags(folder, steps, ours=True, marked=True):
    for step in steps:
        tag = folder / tag_for(step)
        tag.mkdir()
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
        if marked:
            _write_marker(str(tag), step, 1, "pretrain")
        if ours:
            _record(str(folder), tag_for(step), "complete" if marked else "started")


@pytest.mark.parametrize("keep_last", [1, 2, 3, 10])
def test_keep_last_keeps_the_newest_complete_tags(tmp_path, keep_last):
    _make_tags(tmp_path, [2, 4, 6, 8, 10])
    _make_tags(tmp_path, [12], marked=False)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    _write_latest(str(tmp_path), tag_for(10))  # step 12 was being written when the run died
    _prune(str(tmp_path), keep_last)
    complete = [2, 4, 6, 8, 10]
    expected = {tag_for(s) for s in complete[-keep_last:]} | {"latest", "notes.txt", ckpt.LEDGER}
    assert {p.name for p in tmp_path.iterdir()} == expected
    assert (tmp_path / "latest").read_text() == tag_for(10)
    assert sorted(ckpt.read_ledger(str(tmp_path))) == sorted(tag_for(s) for s in complete[-keep_last:])


def test_tags_are_ordered_by_step_number_not_by_name(tmp_path):
    for name in ("step9", "step10", "step100"):  # unpadded: by name step9 would be the newest
        (tmp_path / name).mkdir()
        _record(str(tmp_path), name, "complete")
    _write_latest(str(tmp_path), "step100")
    _prune(str(tmp_path), 2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step10", "step100"]


def test_only_the_runs_own_tags_are_pruned(tmp_path):
    """A user's step1/ with notes, a copied complete tag, another run's folder through a symlink: all survive."""
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    (ckpt_dir / "step1").mkdir()
    (ckpt_dir / "step1" / "notes.txt").write_text("my notes")
    _make_tags(ckpt_dir, [99], ours=False)  # copied here from elsewhere: complete, with its marker
    other = tmp_path / "other_run" / "checkpoints"
    other.mkdir(parents=True)
    _make_tags(other, [3])
    os.symlink(other / tag_for(3), ckpt_dir / tag_for(3))
    _record(str(ckpt_dir), tag_for(3), "complete")  # even if the ledger named it: never through a symlink
    _make_tags(ckpt_dir, [5, 6, 7])
    _write_latest(str(ckpt_dir), tag_for(7))
    _prune(str(ckpt_dir), 1)
    assert (ckpt_dir / "step1" / "notes.txt").read_text() == "my notes"
    assert (ckpt_dir / tag_for(99) / ckpt.COMPLETE).is_file()
    assert (other / tag_for(3) / "mp_rank_00_model_states.pt").is_file() and os.path.islink(ckpt_dir / tag_for(3))
    assert not (ckpt_dir / tag_for(5)).exists() and not (ckpt_dir / tag_for(6)).exists()
    assert (ckpt_dir / tag_for(7)).is_dir()


def test_a_save_onto_a_folder_the_run_did_not_write_is_refused(tmp_path):
    _make_tags(tmp_path, [99], ours=False)
    with pytest.raises(ckpt.CheckpointError, match=f"{tag_for(99)}: exists and was not written by this run"):
        ckpt.refuse_foreign(str(tmp_path), tag_for(99))
    _make_tags(tmp_path, [12], marked=False)  # this run's own half-written tag: replaced at the save
    ckpt.refuse_foreign(str(tmp_path), tag_for(12))


def test_a_symlinked_checkpoints_folder_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.symlink(shared, tmp_path / "checkpoints")
    with pytest.raises(ckpt.CheckpointError, match="checkpoints: a symlink"):
        ckpt.refuse_symlinked(str(tmp_path / "checkpoints"))
    ckpt.refuse_symlinked(str(shared))


def test_resume_from_an_older_tag_is_refused_unless_discard_newer(tmp_path):
    _make_tags(tmp_path, [9, 12])
    _make_tags(tmp_path, [15], marked=False)  # half-written: not work to keep
    _write_latest(str(tmp_path), tag_for(12))
    with pytest.raises(ckpt.CheckpointError, match=f"{tag_for(12)} is newer and complete.*run.discard_newer=true"):
        ckpt.check_newer_tags(str(tmp_path), tag_for(9), discard=False)
    assert (tmp_path / tag_for(12)).is_dir()
    assert ckpt.check_newer_tags(str(tmp_path), tag_for(12), discard=False) == []
    assert ckpt.check_newer_tags(str(tmp_path), tag_for(9), discard=True) == [tag_for(12)]
    assert ckpt.discard_newer(str(tmp_path), tag_for(9)) == [tag_for(12)]
    assert not (tmp_path / tag_for(12)).exists() and ckpt.read_latest(str(tmp_path)) == tag_for(9)

"""``run.keep_last``: after a save, the checkpoints folder keeps the newest ``keep_last`` complete tags (the one
``latest`` names and those before it); older tags and tags newer than ``latest`` (half-written by an attempt
that was killed while saving) are removed; other files stay."""
import pytest

from mplug_pretrain.train.checkpoint import _prune, _write_latest, tag_for


def _make_tags(folder, steps):
    for step in steps:
        (folder / tag_for(step)).mkdir()
        (folder / tag_for(step) / "mp_rank_00_model_states.pt").write_bytes(b"x")


@pytest.mark.parametrize("keep_last", [1, 2, 3, 10])
def test_keep_last_keeps_the_newest_complete_tags(tmp_path, keep_last):
    _make_tags(tmp_path, [2, 4, 6, 8, 10, 12])
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    _write_latest(str(tmp_path), tag_for(10))  # step 12 was being written when the run died
    _prune(str(tmp_path), keep_last)
    complete = [2, 4, 6, 8, 10]
    expected = {tag_for(s) for s in complete[-keep_last:]} | {"latest", "notes.txt"}
    assert {p.name for p in tmp_path.iterdir()} == expected
    assert (tmp_path / "latest").read_text() == tag_for(10)


def test_tags_are_ordered_by_step_number_not_by_name(tmp_path):
    for name in ("step9", "step10", "step100"):  # unpadded: by name step9 would be the newest
        (tmp_path / name).mkdir()
    _write_latest(str(tmp_path), "step100")
    _prune(str(tmp_path), 2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step10", "step100"]

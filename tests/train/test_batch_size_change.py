"""Issue 37, item 4: an accepted data.batch_size change (run.allow_config_change) states at resume how many samples
of the resumed epoch will not be seen (or be seen twice). Expected counts from a simulation of the data position:
each rank's share of the epoch as a list of sample indices, the batches taken before and after the resume."""
import pytest

from mplug_pretrain.train.config_change import batch_size_change_note


def _unseen_and_repeated(share: int, saved: int, new: int, batch_in_epoch: int) -> tuple[int, int]:
    order = list(range(share))
    before = order[: batch_in_epoch * saved]  # consumed in batches of the saved size
    after = order[batch_in_epoch * new:]  # the resumed loader starts at batch `batch_in_epoch` of the new size
    seen = before + after
    return len(set(order) - set(seen)), len(seen) - len(set(seen))


@pytest.mark.parametrize(("saved", "new", "batch"), [(4, 8, 9), (8, 4, 5), (4, 6, 3)])
def test_the_note_counts_what_the_resumed_epoch_skips_or_repeats(saved, new, batch):
    world, share = 2, 80  # the issue's case: 160 samples, 2 ranks, 4 -> 8 at batch 9 leaves 72 unseen
    unseen, repeated = _unseen_and_repeated(share, saved, new, batch)
    note = batch_size_change_note(saved, new, epoch=0, batch_in_epoch=batch, world=world)
    assert f"data.batch_size changed {saved} -> {new}" in note
    if new > saved:
        assert f": {unseen * world} samples of this epoch ({unseen} per rank x {world} rank(s)) will not be seen" in note
    else:
        assert f": {repeated * world} samples of this epoch ({repeated} per rank x {world} rank(s)) will be seen twice" \
            in note


def test_the_issue_numbers():
    note = batch_size_change_note(4, 8, epoch=0, batch_in_epoch=9, world=2)
    assert "72 samples of this epoch (36 per rank x 2 rank(s)) will not be seen" in note


def test_no_note_without_a_change_or_at_an_epoch_start():
    assert batch_size_change_note(4, 4, 0, 9, 2) is None
    assert batch_size_change_note(4, 8, 1, 0, 2) is None
    assert batch_size_change_note(None, 8, 0, 9, 2) is None

"""The layout rules of a resume on another rank count (train/world_change.py), without processes."""
import pytest

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.train.checkpoint import TrainerState
from mplug_pretrain.train.world_change import (
    LayoutChange,
    end_epoch,
    keep_global_batch,
    mark_resplit,
    merged_trainer_state,
    resplit_point,
)


@pytest.mark.parametrize("global_batch, batch, accum, world, expected", [
    (8, 4, 1, 1, (4, 2)),      # fewer ranks: more accumulation, same micro-batch
    (8, 4, 2, 2, (4, 1)),      # back again
    (8, 4, 1, 2, (4, 1)),      # unchanged
    (8, 8, 1, 2, (4, 1)),      # the micro-batch does not divide: accumulation kept, batch re-derived
    (12, 4, 1, 2, (6, 1)),
    (8, 4, 1, 3, None),        # nothing gives 8 on 3 ranks
])
def test_keep_global_batch(global_batch, batch, accum, world, expected):
    pair = keep_global_batch(global_batch, batch, accum, world)
    assert pair == expected
    if pair is not None:
        assert pair[0] * pair[1] * world == global_batch


def _change(**kw):
    base = {"saved_world": 2, "world": 1, "saved_batch": 4, "batch": 4, "saved_accum": 1, "accum": 2,
            "saved_workers": 1, "workers": 1, "saved_stage": 2, "stage": 3}
    return LayoutChange(**{**base, **kw})


def test_the_epoch_rest_is_marked_then_dropped_when_the_epoch_ends():
    state = TrainerState(global_step=2, epoch=0, batch_in_epoch=2)
    assert "re-split over 1 x 1" in mark_resplit(state, _change(), "ckpt/step2")
    point = resplit_point(state)
    assert (point.world_size, point.num_workers, point.batch_size, point.batches) == (2, 1, 4, 2)
    state.epoch += 1
    end_epoch(state)
    assert resplit_point(state) is None and "resplit" not in state.extra


def test_an_epoch_start_or_the_same_layout_needs_no_resplit():
    assert mark_resplit(TrainerState(batch_in_epoch=0), _change(), "t") is None
    same = _change(world=2, accum=1, saved_stage=2, stage=2)
    assert not same.changed and mark_resplit(TrainerState(batch_in_epoch=3), same, "t") is None


def test_a_second_layout_inside_a_resplit_epoch_is_refused():
    state = TrainerState(epoch=1, batch_in_epoch=6)
    mark_resplit(state, _change(), "t")
    with pytest.raises(ConfigError, match="epoch 1 was already re-split .* until epoch 1 ends"):
        mark_resplit(state, _change(saved_world=1, world=2, accum=1), "ckpt/step6")


def test_merged_state_keeps_the_position_and_gives_the_counts_to_rank0():
    states = [TrainerState(global_step=4, samples_seen=32, epoch=0, batch_in_epoch=4, data_counts={"decoded": 16}),
              TrainerState(global_step=4, samples_seen=32, epoch=0, batch_in_epoch=4,
                           data_counts={"decoded": 15, "corrupt": 1})]
    zero, other = merged_trainer_state(states, 0), merged_trainer_state(states, 1)
    assert (zero.global_step, zero.samples_seen, zero.batch_in_epoch) == (4, 32, 4)
    assert zero.data_counts == {"decoded": 31, "corrupt": 1} and other.data_counts == {}
    states[1].batch_in_epoch = 3
    with pytest.raises(ConfigError, match="ranks disagree"):
        merged_trainer_state(states, 0)

"""The CUDA train-step bench's logic on CPU: the largest-batch search doubles until the first
torch.cuda.OutOfMemoryError and keeps the last batch that fitted; the tiled batch has the preset's
resolution and distinct image ids. (The GPU figures themselves need a GPU.)"""
import pytest
import torch

from mplug_pretrain.bench.train_step_gpu import _tiled_batch, largest_batch


def _fits_up_to(limit, calls):
    def measure(preset, stage, ckpt, batch):
        calls.append(batch)
        if batch > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at batch {batch}")
        return {"preset": preset, "zero_stage": stage, "grad_checkpointing": ckpt, "batch_per_rank": batch}
    return measure


@pytest.mark.parametrize("limit, best, oom_at", [(100, 64, 128), (8, 8, 16), (5000, 1024, None)])
def test_largest_batch_doubles_until_out_of_memory(limit, best, oom_at):
    calls = []
    row = largest_batch("base", 2, False, start=8, limit=1024, measure=_fits_up_to(limit, calls))
    assert row["batch_per_rank"] == best and row["oom_at"] == oom_at
    assert calls == row["tried_batches"] == [b for b in (8, 16, 32, 64, 128, 256, 512, 1024) if b <= (oom_at or 1024)]


def test_nothing_fits_gives_none():
    assert largest_batch("large", 0, False, start=8, measure=_fits_up_to(4, [])) is None


def test_other_errors_are_not_swallowed():
    def broken(*_):
        raise RuntimeError("not an OOM")
    with pytest.raises(RuntimeError, match="not an OOM"):
        largest_batch("base", 2, False, measure=broken)


def test_tiled_batch_shape_and_ids(demo_shards):
    batch = _tiled_batch("tiny", 40, "cpu")
    assert batch["image"].shape == (40, 3, 64, 64)
    assert batch["input_ids"].shape[0] == 40
    assert torch.equal(batch["image"][16], batch["image"][0])  # tiled from one real batch of 16
    if "image_id" in batch:
        assert len(set(batch["image_id"].tolist())) == 40

"""MPLUG.forward on blank pad rows (``ImageTextFormat.blank()``: image_id -1, is_pad), the rows a loader slot
emits before it has seen any real sample: a batch of blanks only trains nothing (zero loss, zero gradient, no
queue row) instead of raising; blank rows beside real ones are left out of every loss."""
import pytest
import torch

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.formats.samples import ImageTextFormat
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.data.transforms import build_eval_transform
from mplug_pretrain.models.mplug import LOSS_NAMES, MPLUG
from mplug_pretrain.models.presets import get_preset_config


@pytest.fixture(scope="module")
def model_and_format():
    torch.manual_seed(0)
    config = get_preset_config("tiny")
    config.heads.queue_size = 16
    size = config.vision.image_size
    return MPLUG(config).train(), ImageTextFormat(build_eval_transform(size), load_tokenizer(), 16, size)


def _real(fmt, i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"image": torch.rand(3, fmt.image_size, fmt.image_size, generator=g), "text": f"a red square number {i}",
            "image_id": i, "__key__": f"k{i}"}


def test_a_batch_of_blank_rows_trains_nothing_and_leaves_the_queues_alone(model_and_format):
    model, fmt = model_and_format
    batch = fmt.collate([fmt.blank() for _ in range(3)], [True] * 3)
    assert batch["image_id"].tolist() == [-1, -1, -1]
    queue = (int(model.itc.queue_ptr), int(model.itc.queue_count), model.itc.idx_queue.clone())
    model.zero_grad(set_to_none=True)
    out = model(batch)
    assert set(out) == {"loss", *(f"loss_{n}" for n in LOSS_NAMES)}
    assert all(float(v.detach()) == 0.0 for v in out.values()), out
    out["loss"].backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads, "the blank batch must still run backward through the model (every rank steps alike)"
    assert all(bool((g == 0).all()) for g in grads)
    assert (int(model.itc.queue_ptr), int(model.itc.queue_count)) == queue[:2]
    assert torch.equal(model.itc.idx_queue, queue[2])


def test_blank_rows_beside_real_ones_are_left_out(model_and_format):
    model, fmt = model_and_format
    real = [_real(fmt, i) for i in (3, 4)]
    mixed = fmt.collate(real + [fmt.blank(), fmt.blank()], [False, False, True, True])
    alone = fmt.collate(real, [False, False])
    count = int(model.itc.queue_count)
    torch.manual_seed(7)  # the same draws (dropout, MLM masks, hard negatives) on the same two rows
    with_blanks = model(mixed)
    assert int(model.itc.queue_count) == count + 2  # only the real rows are enqueued
    model.itc.queue_ptr.fill_((int(model.itc.queue_ptr) - 2) % model.itc.queue_size)
    model.itc.queue_count.fill_(count)
    torch.manual_seed(7)
    without = model(alone)
    for key in without:
        torch.testing.assert_close(with_blanks[key], without[key], msg=key)

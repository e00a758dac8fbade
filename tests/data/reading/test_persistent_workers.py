"""Persistent DataLoader workers: one ShardLoader iterated epoch after epoch (and moved with set_epoch, as the
training loop does) yields exactly the batches a fresh loader per epoch yields, from the same worker processes."""
import os

import torch
from torch.utils.data import get_worker_info

from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from tests.data.shard_samples import write_simple_shards


def _keys(batches):
    return [list(b["__key__"]) for b in batches]


def test_one_loader_over_epochs_equals_fresh_loaders_and_keeps_its_workers(tmp_path, tokenizer, monkeypatch):
    pattern, _ = write_simple_shards(str(tmp_path), [7, 5, 6, 4])
    spec = LoaderSpec(pattern, 3, num_workers=2, seed=11, shuffle_buffer=5, rank=0, world_size=1)

    def build(epoch=0, start_batch=0):
        import dataclasses
        return build_pretrain_loader(dataclasses.replace(spec, epoch=epoch, start_batch=start_batch), tokenizer,
                                     image_size=16, max_text_len=8, augment=True, uint8_images=True)

    # the worker pid rides along in each batch (the format's collate runs in the worker)
    from mplug_pretrain.data.formats.samples import ImageTextFormat
    collate = ImageTextFormat.collate

    def collate_with_pid(self, samples, is_pad):
        batch = collate(self, samples, is_pad)
        batch["pid"] = os.getpid() if get_worker_info() is not None else -1
        return batch
    monkeypatch.setattr(ImageTextFormat, "collate", collate_with_pid)

    persistent = build()
    passes, pids, real_rows = [], set(), 0
    for epoch, start in ((0, 0), (1, 0), (2, 4), (3, 0)):
        persistent.set_epoch(epoch, start)
        batches = list(persistent)
        pids |= {b["pid"] for b in batches}
        real_rows += sum(int((~b["is_pad"]).sum()) for b in batches)
        fresh = list(build(epoch, start))
        assert _keys(batches) == _keys(fresh), (epoch, start)
        for a, b in zip(batches, fresh):
            assert torch.equal(a["image"], b["image"]) and torch.equal(a["is_pad"], b["is_pad"])
        passes.append(_keys(batches))
    assert len(passes[2]) == persistent.num_batches - 4
    assert passes[0] != passes[1]  # each epoch its own order
    assert len(pids) == 2 and -1 not in pids  # the same two worker processes served every pass
    # counts: every pass adds its own (22 samples a full epoch; the resumed pass decodes only what it yields)
    assert persistent.stats.counts["decoded"] == real_rows and 22 * 3 < real_rows < 22 * 4

"""`mplug bench data-peer`: our WebDataset training pipeline (the pretraining loader as the training tasks build it:
uint8 batches, torch-resized crop, JPEG draft mode, normalisation left to the training device) against open_clip's
own `open_clip_train.data.get_wds_dataset` (the installed open_clip_train package, called as is), on the same
shards of real-size photos (640 x 480 JPEGs, bench/photo_shards.py) at 256 px, with the same augmentation
(RandomResizedCrop + RandAugment; open_clip gets data/transforms.build_train_transform, which ends in ToTensor +
Normalize in its workers, as its own transforms do) and the same WordPiece tokenizer (max 30 tokens; open_clip
calls it once per caption with fixed-length padding, as its own tokenizers do; ours tokenizes once per batch).
Both run in training mode (shard + sample shuffling), batch 32, 1 and 2 DataLoader workers.

samples_per_s = samples in ``timed_batches`` batches / their wall time; the clock starts after the first batch
(worker start-up and shuffle-buffer fill excluded). Measurements alternate ours / open_clip (open_clip / ours the
next round) at each worker count; each row is the median over the rounds, with the 1-minute load averages seen.
Rows: workers, ours_samples_per_s, open_clip_samples_per_s, ratio (ours / open_clip; > 1 means we are faster),
timed_batches, rounds, load_avg_1min.
"""
from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Iterable

from mplug_pretrain.bench.common import write_bench
from mplug_pretrain.bench.dataloader import timed_rate
from mplug_pretrain.bench.photo_shards import ensure_photo_shards
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.data.transforms import build_train_transform

BATCH_SIZE, IMAGE_SIZE, QUICK_IMAGE_SIZE, MAX_TEXT_LEN = 32, 256, 64, 30


def _samples_per_s(loader: Iterable, timed_batches: int, count: Callable[[object], int]) -> float:
    samples, seconds = timed_rate(loader, timed_batches, count)
    return samples / seconds


def _ours(shards: str, workers: int, tokenizer, image_size: int):
    spec = LoaderSpec(shards, BATCH_SIZE, workers, rank=0, world_size=1)
    return build_pretrain_loader(spec, tokenizer, image_size=image_size, max_text_len=MAX_TEXT_LEN, augment=True,
                                 uint8_images=True)


def _import_get_wds_dataset():
    """open_clip_train/data.py imports pandas at the top for its CSV dataset only (``pd.read_csv`` in
    CsvDataset); pandas is not a dependency of ours. When it is absent, a module that raises on any use stands
    in, so open_clip's WebDataset code runs unmodified and a CSV path could not silently misbehave."""
    import sys
    import types
    absent = None
    try:
        import pandas  # noqa: F401
    except ImportError:
        absent = types.ModuleType("pandas")

        def _missing(name: str):
            if name.startswith("__"):  # introspection (hasattr(m, "__file__"), torch.compile's module scan)
                raise AttributeError(name)
            raise ImportError(f"pandas.{name}: pandas is not installed (only open_clip's CSV dataset needs it)")
        absent.__getattr__ = _missing
        sys.modules["pandas"] = absent
    try:
        import open_clip_train.data as oc_data
    finally:  # open_clip's module keeps its reference; nobody else may import the stand-in as pandas
        if absent is not None and sys.modules.get("pandas") is absent:
            del sys.modules["pandas"]
    from webdataset.tariterators import tar_file_expander, url_opener

    import mplug_pretrain  # noqa: F401  (torchvision shim before open_clip)

    def tarfile_to_samples_nothrow(src, handler=oc_data.log_and_continue):
        # open_clip's own function, with one change: webdataset >= 1.0 ends every shard with an empty EOF
        # dict, which open_clip_train 3.3's group_by_keys_nothrow indexes as a file (KeyError 'fname');
        # eof_value=None restores the stream it was written for
        files = tar_file_expander(url_opener(src, handler=handler), handler=handler, eof_value=None)
        return oc_data.group_by_keys_nothrow(files, handler=handler)
    oc_data.tarfile_to_samples_nothrow = tarfile_to_samples_nothrow  # get_wds_dataset looks it up per call
    return oc_data.get_wds_dataset


def _open_clip(shards: str, workers: int, tokenizer, num_samples: int, image_size: int):
    get_wds_dataset = _import_get_wds_dataset()

    def tokenize_caption(text: str):
        return tokenizer([text], padding="max_length", truncation=True, max_length=MAX_TEXT_LEN,
                         return_tensors="pt")["input_ids"]

    args = argparse.Namespace(train_data=shards, val_data=None, train_num_samples=num_samples, seed=0,
                              batch_size=BATCH_SIZE, world_size=1, workers=workers, dataset_resampled=False,
                              train_data_upsampling_factors=None)
    return get_wds_dataset(args, build_train_transform(image_size), is_train=True, epoch=0,
                           tokenizer=tokenize_caption).dataloader


def run(out: str, quick: bool = False, rounds: int | None = None, timed_batches: int | None = None) -> dict:
    """quick (the test suite): 64 px, 1 worker, 3 timed batches, one round."""
    from mplug_pretrain.data.formats.manifest import shard_sample_counts
    from mplug_pretrain.data.reading.urls import all_shards, expand_sources
    shards = ensure_photo_shards()
    num_samples = sum(shard_sample_counts(all_shards(expand_sources(shards, None))))
    tokenizer = load_tokenizer()
    image_size = QUICK_IMAGE_SIZE if quick else IMAGE_SIZE
    timed_batches = timed_batches or (3 if quick else 12)
    rounds = rounds or (1 if quick else 3)
    measure = {
        "ours": lambda w: _samples_per_s(_ours(shards, w, tokenizer, image_size), timed_batches,
                                         lambda b: int((~b["is_pad"]).sum())),
        "open_clip": lambda w: _samples_per_s(_open_clip(shards, w, tokenizer, num_samples, image_size),
                                              timed_batches, lambda b: len(b[0])),
    }
    rows = []
    for workers in ((1,) if quick else (1, 2)):
        rates, loads = {"ours": [], "open_clip": []}, []
        for round_index in range(rounds):
            for name in (("ours", "open_clip") if round_index % 2 == 0 else ("open_clip", "ours")):
                loads.append(os.getloadavg()[0])
                rates[name].append(measure[name](workers))
        ours, peer = statistics.median(rates["ours"]), statistics.median(rates["open_clip"])
        rows.append({"workers": workers, "ours_samples_per_s": ours, "open_clip_samples_per_s": peer,
                     "ratio": ours / peer, "timed_batches": timed_batches, "rounds": rounds,
                     "ours_each": rates["ours"], "open_clip_each": rates["open_clip"],
                     "load_avg_1min": [min(loads), max(loads)]})
    return write_bench("data_peer", rows, out, quick=quick, batch_size=BATCH_SIZE, image_size=image_size,
                       shards=shards, photo_size="640x480",
                       peer="open_clip_train.data.get_wds_dataset (open_clip_torch 3.3.0)")

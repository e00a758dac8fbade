"""`mplug bench dataloader`: samples/s of the full training pipeline (tar read, JPEG decode,
RandomResizedCrop + RandAugment, normalize, WordPiece tokenize, batch) on the demo pretraining
shards, with 1 and 2 DataLoader workers. The clock starts at the first batch, so worker start-up
is excluded; rows: workers, samples_per_s, samples, seconds."""
from __future__ import annotations

import time

from mplug_pretrain.bench.common import write_bench
from mplug_pretrain.data.demo_shards import ensure_demo_shards
from mplug_pretrain.data.pipeline import build_pretrain_loader
from mplug_pretrain.data.tokenizer import load_tokenizer

BATCH_SIZE = 32
IMAGE_SIZE = 64
MAX_TEXT_LEN = 30


def measure(urls: str, workers: int, timed_batches: int, tokenizer) -> dict:
    loader = build_pretrain_loader(urls, batch_size=BATCH_SIZE, image_size=IMAGE_SIZE, max_text_len=MAX_TEXT_LEN,
                                   tokenizer=tokenizer, num_workers=workers, mode="exact", seed=0, train=True)
    samples, start = 0, None
    for i, batch in enumerate(loader):
        if start is None:
            start = time.perf_counter()  # after the first batch: workers are up
            continue
        samples += int((~batch["is_pad"]).sum())
        if i == timed_batches:
            break
    seconds = time.perf_counter() - start
    return {"workers": workers, "samples_per_s": samples / seconds, "samples": samples, "seconds": seconds}


def run(out: str, quick: bool = False) -> dict:
    paths = ensure_demo_shards()
    tokenizer = load_tokenizer()
    timed_batches = 12 if quick else 120
    rows = [measure(paths["pretrain_train"], workers, timed_batches, tokenizer) for workers in (1, 2)]
    return write_bench("dataloader", rows, out, batch_size=BATCH_SIZE, image_size=IMAGE_SIZE,
                       shards=paths["pretrain_train"])

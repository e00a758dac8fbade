"""`mplug bench dataloader`: samples/s of the full training pipeline (tar read, JPEG decode,
RandomResizedCrop + RandAugment, normalize, WordPiece tokenize, batch) on the demo pretraining
shards, with 1 and 2 DataLoader workers, at the tiny preset's 64 px and at the base preset's real
256 px. The clock starts at the first batch, so worker start-up is excluded.
Rows: image_size, workers, samples_per_s, samples_per_s_per_worker, samples, seconds.

How many workers feed one GPU: workers >= GPU samples/s (bench train-step) / samples_per_s_per_worker
at 256 px, on as many free cores. More workers: ``python -m mplug_pretrain.bench.dataloader --workers 1 2 4 8
--image-size 256 --out FILE.json``. The demo JPEGs are small (so decoding costs less than for COCO-sized
photos: they are 64 x 64, upsampled by RandomResizedCrop; at 256 px the augmentation and normalisation
of the 256 x 256 output dominate).
"""
from __future__ import annotations

import argparse
import time

from mplug_pretrain.bench.common import write_bench
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.demo.shards import ensure_demo_shards

BATCH_SIZE = 32
IMAGE_SIZES = (64, 256)  # tiny preset, base preset (mPLUG's pretraining resolution)
MAX_TEXT_LEN = 30


def measure(urls: str, workers: int, timed_batches: int, tokenizer, image_size: int = 64) -> dict:
    loader = build_pretrain_loader(LoaderSpec(urls, BATCH_SIZE, workers), tokenizer, image_size=image_size,
                                   max_text_len=MAX_TEXT_LEN, augment=True)
    samples, start = 0, None
    for i, batch in enumerate(loader):
        if start is None:
            start = time.perf_counter()  # after the first batch: workers are up
            continue
        samples += int((~batch["is_pad"]).sum())
        if i == timed_batches:
            break
    seconds = time.perf_counter() - start
    rate = samples / seconds
    return {"image_size": image_size, "workers": workers, "samples_per_s": rate,
            "samples_per_s_per_worker": rate / max(workers, 1), "samples": samples, "seconds": seconds}


def run(out: str, quick: bool = False, workers: tuple[int, ...] = (1, 2),
        image_sizes: tuple[int, ...] | None = None, timed_batches: int | None = None) -> dict:
    """quick (the test suite): 64 px only, 12 timed batches."""
    image_sizes = image_sizes or ((IMAGE_SIZES[0],) if quick else IMAGE_SIZES)
    paths = ensure_demo_shards()
    tokenizer = load_tokenizer()
    timed_batches = timed_batches or (12 if quick else 120)
    rows = [measure(paths["pretrain_train"], w, timed_batches, tokenizer, size)
            for size in image_sizes for w in workers]
    return write_bench("dataloader", rows, out, batch_size=BATCH_SIZE, image_sizes=list(image_sizes),
                       shards=paths["pretrain_train"], timed_batches=timed_batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--image-size", type=int, nargs="+", default=list(IMAGE_SIZES))
    parser.add_argument("--batches", type=int, default=120, help="timed batches of 32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = run(args.out, workers=tuple(args.workers), image_sizes=tuple(args.image_size),
                 timed_batches=args.batches)
    for row in result["rows"]:
        print(row, flush=True)


if __name__ == "__main__":
    main()

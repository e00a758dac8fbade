"""`mplug bench dataloader`: samples/s of the pretraining loader (tar read, JPEG decode, RandomResizedCrop +
RandAugment, WordPiece tokenize, batch) at 256 px from real-size 640 x 480 photo JPEGs (bench/photo_shards.py),
the loader as it was ("before": ToTensor + Normalize in the worker, PIL's resize, float32 batches) against the
loader the training tasks use now ("after": uint8 batches, torch's resize, JPEG draft mode, normalisation on the
training device), in-process (0 workers: one core's work, timed by CPU time as well as by the clock) and with 1
and 2 DataLoader workers.

Rounds alternate before / after (after / before the next round) so a load change on the shared machine hits both;
every row records the 1-minute load average when it started. The clock starts at the first batch (worker start-up
excluded). Rows: pipeline, image_size, workers, round, samples_per_s, samples_per_s_per_worker, samples, seconds,
load_avg_1min (+ samples_per_cpu_s in-process). ``summary``: per worker count the median samples/s per worker of
each pipeline and after / before (in-process also per CPU-second: the per-core figure on a shared machine).

How many workers feed one GPU: workers >= GPU samples/s (bench train-step) / samples_per_s_per_worker, on as many
free cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from mplug_pretrain.bench.common import write_bench
from mplug_pretrain.bench.photo_shards import ensure_photo_shards
from mplug_pretrain.data.formats.samples import ImageTextFormat
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_loader, build_pretrain_loader
from mplug_pretrain.data.tokenizer import load_tokenizer
from mplug_pretrain.data.transforms import build_train_transform

BATCH_SIZE, MAX_TEXT_LEN = 32, 30
PIPELINES = ("before", "after")


def build(pipeline: str, urls: str, workers: int, tokenizer, image_size: int):
    spec = LoaderSpec(urls, BATCH_SIZE, workers, rank=0, world_size=1)
    if pipeline == "before":  # the float transform in the worker, as every training loader did before issue 35
        return build_loader(spec, ImageTextFormat(build_train_transform(image_size), tokenizer, MAX_TEXT_LEN,
                                                  image_size))
    return build_pretrain_loader(spec, tokenizer, image_size=image_size, max_text_len=MAX_TEXT_LEN, augment=True,
                                 uint8_images=True)


def timed_rate(loader, timed_batches: int, count=lambda b: int((~b["is_pad"]).sum())) -> tuple[int, float]:
    """(samples, seconds) over ``timed_batches`` batches after the first."""
    samples, start = 0, None
    for i, batch in enumerate(loader):
        if start is None:
            start = time.perf_counter()  # after the first batch: workers are up
            continue
        samples += count(batch)
        if i == timed_batches:
            break
    return samples, time.perf_counter() - start


def measure(pipeline: str, urls: str, workers: int, timed_batches: int, tokenizer, image_size: int,
            round_index: int) -> dict:
    """workers 0: the pipeline in this process on one torch thread, as a DataLoader worker runs it, timed by this
    process's CPU time too (``samples_per_cpu_s``: samples per second of one core, whatever else the machine
    runs)."""
    import torch
    load = os.getloadavg()[0]
    threads = torch.get_num_threads()
    if workers == 0:
        torch.set_num_threads(1)
    cpu_start = time.process_time()
    try:
        samples, seconds = timed_rate(build(pipeline, urls, workers, tokenizer, image_size), timed_batches)
    finally:
        torch.set_num_threads(threads)
    rate = samples / seconds
    row = {"pipeline": pipeline, "image_size": image_size, "workers": workers, "round": round_index,
           "samples_per_s": rate, "samples_per_s_per_worker": rate / max(workers, 1), "samples": samples,
           "seconds": seconds, "load_avg_1min": load}
    if workers == 0:  # (the first, untimed batch's CPU time is included: a slight underestimate of the rate)
        row["samples_per_cpu_s"] = samples / (time.process_time() - cpu_start)
    return row


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for workers in sorted({r["workers"] for r in rows}):
        median = {p: statistics.median(r["samples_per_s_per_worker"] for r in rows
                                       if r["workers"] == workers and r["pipeline"] == p) for p in PIPELINES}
        entry = {"workers": workers, "before_per_worker": median["before"], "after_per_worker": median["after"],
                 "after_over_before": median["after"] / median["before"]}
        if workers == 0:
            cpu = {p: statistics.median(r["samples_per_cpu_s"] for r in rows if r["workers"] == 0 and r["pipeline"] == p)
                   for p in PIPELINES}
            entry.update(before_per_cpu_s=cpu["before"], after_per_cpu_s=cpu["after"],
                         after_over_before_cpu=cpu["after"] / cpu["before"])
        out.append(entry)
    return out


def run(out: str, quick: bool = False, workers: tuple[int, ...] = (0, 1, 2), image_size: int | None = None,
        timed_batches: int | None = None, rounds: int | None = None) -> dict:
    """quick (the test suite): 64 px, in-process, 3 timed batches, one round."""
    image_size = image_size or (64 if quick else 256)
    workers = (0,) if quick else workers
    timed_batches = timed_batches or (3 if quick else 15)
    rounds = rounds or (1 if quick else 3)
    urls, tokenizer = ensure_photo_shards(), load_tokenizer()
    rows = []
    for round_index in range(rounds):
        for w in workers:
            order = PIPELINES if round_index % 2 == 0 else PIPELINES[::-1]
            rows.extend(measure(p, urls, w, timed_batches, tokenizer, image_size, round_index) for p in order)
    return write_bench("dataloader", rows, out, summary=summarize(rows), batch_size=BATCH_SIZE,
                       image_size=image_size, shards=urls, photo_size="640x480", timed_batches=timed_batches,
                       cpu_count=os.cpu_count())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="0: in-process, CPU-timed")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=15, help="timed batches of 32 per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = run(args.out, workers=tuple(args.workers), image_size=args.image_size, timed_batches=args.batches,
                 rounds=args.rounds)
    for row in result["rows"]:
        print(row, flush=True)
    print(result["summary"], flush=True)


if __name__ == "__main__":
    main()

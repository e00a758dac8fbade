"""Counts of what the reader skipped, decoded and padded.

Each worker process counts into its own ``DecodeStats``; every batch it emits carries the counts
added since its previous batch (``take_delta()``, a small dict under ``batch["__stats__"]``), and
the loader in the main process ``merge``s them, so the main process sees all workers' counts.

Counters: ``decoded`` (usable samples), ``padded`` (filler samples flagged ``is_pad``), and the
skip reasons: ``truncated_tar``/``bad_tar`` (per shard), ``missing_samples`` (listed in the
manifest but never read, e.g. behind a truncation), ``missing_image``, ``empty_image``,
``corrupt_image``, ``too_many_pixels`` (over data.max_image_pixels, skipped before decoding), ``missing_caption``, ``bad_caption_encoding``, ``missing_question``,
``bad_question_encoding``, ``bad_json`` (not JSON, or a field of the wrong type), ``bad_image_id`` (an integer
outside int64), ``missing_video``, ``corrupt_video``, ``decode_error`` (any other exception while decoding one
sample), ``collate_error`` (a sample that cannot be batched), ``other`` (a kind not listed here, when summed
over ranks).

A training run keeps each rank's counts across epochs and resumes (``TrainerState.data_counts``) and sums them
over ranks (``sum_over_ranks``) when it logs and at the end.
"""
from __future__ import annotations

from collections import Counter

NOT_SKIPS = ("decoded", "padded")
SHARD_EVENTS = ("truncated_tar", "bad_tar")  # counted per shard; the samples a break lost are missing_samples
KINDS = ("decoded", "padded", "truncated_tar", "bad_tar", "missing_samples", "missing_image", "empty_image",
         "corrupt_image", "too_many_pixels", "missing_caption", "bad_caption_encoding", "missing_question", "bad_question_encoding",
         "bad_json", "bad_image_id", "missing_video", "corrupt_video", "decode_error", "collate_error", "other")


def sum_over_ranks(counts: dict[str, int]) -> dict[str, int]:
    """Counts summed over all ranks (one all-reduce of a ``len(KINDS)`` vector; collective: every rank calls
    it). A kind outside ``KINDS`` is summed as ``other``."""
    from mplug_pretrain.utils import process_group
    vector = [0] * len(KINDS)
    for kind, n in counts.items():
        vector[KINDS.index(kind) if kind in KINDS else KINDS.index("other")] += int(n)
    if process_group.world_size() > 1:
        import torch
        import torch.distributed as dist
        t = torch.tensor(vector, dtype=torch.int64, device=process_group.device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        vector = t.tolist()
    return {kind: n for kind, n in zip(KINDS, vector) if n}


# A field the format reads is absent: what every sample of another kind of shards gives (VQA shards read for
# captions: missing_caption; video shards read for images: missing_image), unlike corrupt or truncated data.
ABSENT_FIELD_SKIPS = ("missing_image", "missing_caption", "missing_question", "missing_video")


def nothing_decoded(counts: dict[str, int]) -> str | None:
    """When samples were read but none decoded: "N skipped (reason=n, ...)", the wording of the refusal a run
    gives (shards of another kind skip every sample for one reason, e.g. VQA shards ``missing_caption``); else
    None."""
    stats = DecodeStats(counts)
    if stats.counts["decoded"] or not stats.total_skipped:
        return None
    return f"{stats.total_skipped} skipped ({', '.join(f'{k}={v}' for k, v in stats.skipped.items())})"


class DecodeStats:
    def __init__(self, counts: dict[str, int] | None = None):
        self.counts: Counter[str] = Counter(counts or {})
        self._reported: Counter[str] = Counter()

    def add(self, kind: str, n: int = 1) -> None:
        if n:
            self.counts[kind] += n

    def merge(self, delta: dict[str, int]) -> None:
        self.counts.update(delta)

    def take_delta(self) -> dict[str, int]:
        """Counts added since the previous call."""
        delta = {k: v - self._reported[k] for k, v in self.counts.items() if v != self._reported[k]}
        self._reported = Counter(self.counts)
        return delta

    @property
    def skipped(self) -> dict[str, int]:
        """Skip reasons with their counts (samples, or shards for ``truncated_tar``/``bad_tar``)."""
        return {k: v for k, v in sorted(self.counts.items()) if k not in NOT_SKIPS and v}

    @property
    def total_skipped(self) -> int:
        """Skipped samples: per-sample reasons plus ``missing_samples`` (tar-level events excluded)."""
        return sum(v for k, v in self.skipped.items() if k not in SHARD_EVENTS)

    def log_line(self) -> str:
        """"[data] decoded D, skipped S (reason=n, ...), padded P" with S the sum of the per-sample reasons; shards
        that broke off are counted apart (they are shards, not samples): "; shards broken off: truncated_tar=n"."""
        samples = {k: v for k, v in self.skipped.items() if k not in SHARD_EVENTS}
        shards = {k: v for k, v in self.skipped.items() if k in SHARD_EVENTS}
        reasons = ", ".join(f"{k}={v}" for k, v in samples.items()) or "none"
        line = (f"[data] decoded {self.counts['decoded']}, skipped {self.total_skipped} "
                f"({reasons}), padded {self.counts['padded']}")
        if shards:
            line += "; shards broken off: " + ", ".join(f"{k}={v}" for k, v in shards.items())
        return line

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def __repr__(self) -> str:
        return f"DecodeStats({self.as_dict()})"

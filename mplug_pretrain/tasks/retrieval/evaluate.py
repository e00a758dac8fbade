"""``mplug eval retrieval``: image-text retrieval (COCO 5k / Flickr30K 1k Karpathy test), zero-shot or tuned.

Input (``cfg.eval``), one of:
  * ``shards`` in the image layout: one sample per image, its texts in ``json.captions``
    (``make-shards coco --layout image``; the demo's ``pretrain_val``);
  * ``annotations``: Karpathy ``dataset_coco.json`` / ``dataset_flickr30k.json`` (split ``eval.split``),
    a COCO captions file (``eval.split: null``), or an ALBEF/BLIP list ``[{"image": path, "caption": [..]}]``,
    with the images under ``image_root``.
Protocol (``metrics/retrieval_scoring.py``): ITC similarity of all pairs, each query's ITC top-``k_test`` re-scored by
ITM (``rerank_score``: itm | itm+itc | itc = no re-ranking). Unreadable images are skipped and counted.
Metrics JSON: task, checkpoint, num_images, num_texts, images_skipped, txt_r1/5/10 (image -> text),
img_r1/5/10 (text -> image), the means, MedR / MeanR, ``itc`` (the same before re-ranking), rerank_score, k_test,
ranks (processes that shared the re-ranking: run under ``torchrun --nproc_per_node N -m mplug_pretrain eval
retrieval ...``, each rank re-ranks 1/N of the pairs; the figures equal one process's).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.metrics.retrieval_scoring import embed_images, embed_texts, evaluate_retrieval
from mplug_pretrain.tasks.evaluation import (
    SkipReport,
    eval_autocast,
    load_eval_model,
    metrics_path,
    write_metrics,
)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- inputs
class _ImageFiles(Dataset):
    """(index, image tensor or None, (skip reason, detail) or None) per file: a bad image is reported,
    not raised."""

    def __init__(self, paths: list[str], image_size: int):
        from mplug_pretrain.data.transforms import build_eval_transform
        self.paths, self.transform = paths, build_eval_transform(image_size)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        from mplug_pretrain.data.formats.image_decode import SampleError, decode_image
        try:
            with open(self.paths[index], "rb") as f:
                return index, self.transform(decode_image(f.read())), None
        except FileNotFoundError as err:
            return index, None, ("missing_image", str(err))
        except (OSError, SampleError) as err:
            return index, None, ("corrupt_image", str(err))


def read_annotations(path: str, image_root: str, split: str | None) -> list[tuple[str, list[str]]]:
    """(image path, captions) per image from a Karpathy / COCO captions file or an ALBEF/BLIP list."""
    from mplug_pretrain.data.writers.coco import load_caption_json
    from mplug_pretrain.data.writers.common import load_json
    if path.endswith(".json"):
        with open(path) as f:
            head = f.read(1).strip() or " "
        if head == "[":
            out = []
            for i, item in enumerate(load_json(path)):
                if not isinstance(item, dict) or "image" not in item or "caption" not in item:
                    raise DataError(f"{path}[{i}]: expected {{'image': path, 'caption': [captions]}}")
                captions = item["caption"] if isinstance(item["caption"], list) else [item["caption"]]
                out.append((os.path.join(image_root, item["image"]), [str(c) for c in captions]))
            return out
    return [(img.path, img.captions) for img in load_caption_json(path, image_root, split)]


ImageBatches = Iterator[tuple[torch.Tensor, list[list[str]]]]  # (images [B, 3, S, S], each image's captions)


def _file_batches(cfg, image_size: int, skipped: SkipReport) -> ImageBatches:
    e = cfg.eval
    if e.image_root is None:
        raise ConfigError("eval.image_root: needed with eval.annotations (where the image paths start)")
    images = read_annotations(e.annotations, e.image_root, e.split)
    loader = DataLoader(_ImageFiles([p for p, _ in images], image_size), batch_size=e.batch_size,
                        num_workers=e.num_workers, collate_fn=list)
    for items in loader:
        for index, _, problem in items:
            if problem is not None:
                skipped.add(images[index][0], *problem)
        good = [(i, tensor) for i, tensor, _ in items if tensor is not None]
        if good:
            yield torch.stack([t for _, t in good]), [images[i][1] for i, _ in good]


def _shard_batches(cfg, image_size: int, skipped: SkipReport) -> ImageBatches:
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_caption_eval_loader
    spec = LoaderSpec.evaluation(cfg.eval.shards, cfg.eval.batch_size, cfg.eval.num_workers, rank=0, world_size=1)
    loader = build_caption_eval_loader(spec, image_size=image_size)  # every rank embeds every image
    for batch in loader:
        keep = ~batch["is_pad"]
        if bool(keep.any()):
            yield batch["image"][keep], [c for c, pad in zip(batch["captions"], batch["is_pad"]) if not pad]
    skipped.add_counts(loader.stats.skipped)


# ----------------------------------------------------------------------------- the task
def evaluate(cfg, model, across_ranks: bool = False) -> dict:
    """Retrieval metrics of ``model`` on the image-text set ``cfg.eval`` names (module docstring).
    ``across_ranks``: every rank of the process group calls this and re-ranks its share of the pairs."""
    e = cfg.eval
    if (e.shards is None) == (e.annotations is None):
        raise ConfigError("eval.shards / eval.annotations: set exactly one (the image-text set to evaluate)")
    from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
    image_size = model.config.vision.image_size
    skipped = SkipReport()
    source = _shard_batches(cfg, image_size, skipped) if e.shards else _file_batches(cfg, image_size, skipped)
    captions: list[list[str]] = []

    def images() -> Iterator[torch.Tensor]:
        for batch_images, batch_captions in source:
            captions.extend(batch_captions)
            yield batch_images

    with eval_autocast(cfg, model):
        visual = embed_images(model, images())
        texts = [c for per_image in captions for c in per_image]
        text_to_image = [i for i, per_image in enumerate(captions) for _ in per_image]
        ids, mask = tokenize(load_tokenizer(cfg.data.tokenizer), texts, e.max_text_len)
        text = embed_texts(model, ids, mask, e.batch_size)
        log.info("retrieval: %d images, %d texts encoded; re-ranking (%s, k=%d)", len(captions), len(texts),
                 e.rerank_score, e.k_test)
        recalls = evaluate_retrieval(model, visual, text, text_to_image, e.k_test, e.rerank_score,
                                     e.batch_size, across_ranks=across_ranks)
    return {"task": "retrieval", "num_images": len(captions), "num_texts": len(texts),
            **skipped.as_dict("images"), **recalls}


def join_launched_group() -> None:
    """Under a launcher that started several processes (torchrun / srun: WORLD_SIZE > 1 in the environment), join
    their process group (nccl on GPUs, each rank on its LOCAL_RANK device; gloo on CPUs) unless one exists."""
    import torch.distributed as dist
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def run(cfg, checkpoint: str, out: str | None = None) -> dict:
    """``mplug eval retrieval --config FILE --checkpoint DIR [--out FILE]`` -> metrics (also written).
    Under torchrun every rank embeds the whole set and re-ranks its share of the pairs (metrics/retrieval_scoring.py);
    rank 0 writes the metrics."""
    from mplug_pretrain.utils.process_group import barrier, rank, world_size
    join_launched_group()
    metrics = {**evaluate(cfg, load_eval_model(cfg, checkpoint), across_ranks=True), "checkpoint": checkpoint,
               "ranks": world_size()}
    if rank() == 0:
        write_metrics(metrics_path(cfg, "retrieval", out), metrics)
    barrier()
    return metrics

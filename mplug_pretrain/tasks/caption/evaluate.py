"""`mplug eval caption`: caption the images of an evaluation split with a model folder and score them.

    image, prompt ("[CLS] a picture of [SEP]") -> MPLUG.memory (text encoder + fusion)
        -> beam search (caption.generation: beam_size 5, at most max_length 20 tokens incl. [SEP], at least
           min_length, final ranking by log-prob / length ** length_penalty)
        -> decoded text (the caption after the prompt)
    scores    eval.caption_metrics "coco": BLEU-1..4, METEOR, ROUGE-L, CIDEr (pycocoevalcap, raw scale: x100 for
              the papers' tables), SPICE where its Stanford CoreNLP jars are present, else one log line saying it
              was skipped; Java is checked before any caption is generated. "cider": CIDEr alone, no Java.
              The predictions are written before scoring.
    files     the metrics JSON (``out`` | eval.output | <run_dir>/metrics_caption.json) and, beside it,
              <out stem>.caption_predictions.json in the COCO results format [{"image_id", "caption"}]
The split: ``eval.shards``, else ``caption.val_shards`` (image-layout shards: json.captions = references).
Under torch.distributed every rank captions its share of the images; rank 0 scores.
``fast_cider_d`` is the Java-free check used between training stages: our CIDEr-D (equal to
pycocoevalcap's Cider on the same words) on ``clean_caption`` words instead of PTB-tokenized ones.
"""
from __future__ import annotations

from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

from mplug_pretrain.config import Config
from mplug_pretrain.models.generation.packed_decoding import packed_for_decoding
from mplug_pretrain.models.generation.settings import GENERATION_FILE, GenerationSettings  # noqa: F401 (re-export)
from mplug_pretrain.models.inference import caption_images
from mplug_pretrain.tasks.evaluation import beside_metrics, load_eval_model, metrics_path, write_metrics
from mplug_pretrain.utils import process_group


def generate_captions(model: nn.Module, loader, tokenizer, settings: GenerationSettings,
                      device: torch.device) -> tuple[dict[int, str], dict[int, list[str]]]:
    """-> ({image_id: caption}, {image_id: reference captions}) for the real (non-padding) images.
    The decoder's weights are packed once for the pass where that applies (models.packed_decoding)."""
    predictions, references = {}, {}
    with packed_for_decoding(model.decoder) as decoder:
        for batch in loader:
            keep = [i for i, pad in enumerate(batch["is_pad"].tolist()) if not pad]
            if not keep:
                continue
            captions = caption_images(model, batch["image"][keep].to(device), tokenizer, settings, decoder)
            for i, caption in zip(keep, captions):
                image_id = int(batch["image_id"][i])
                predictions[image_id] = caption
                references[image_id] = list(batch["captions"][i])
    return predictions, references


def gather_to_all(predictions: dict, references: dict) -> tuple[dict, dict]:
    """Merge every rank's dicts (no-op in a single process)."""
    if process_group.world_size() == 1:
        return predictions, references
    parts: list = [None] * process_group.world_size()
    dist.all_gather_object(parts, (predictions, references))
    merged_p, merged_r = {}, {}
    for p, r in parts:
        merged_p.update(p)
        merged_r.update(r)
    return merged_p, merged_r


def fast_cider_d(predictions: dict[int, str], references: dict[int, list[str]]) -> float:
    """Corpus CIDEr-D (raw scale) of the predictions, df from these references, on clean_caption words."""
    from mplug_pretrain.metrics.cider_d import cider_d
    from mplug_pretrain.tasks.caption.text import clean_caption
    ids = sorted(predictions)
    if not ids:
        raise ValueError("predictions: empty")
    return cider_d([clean_caption(predictions[i]) for i in ids],
                   [[clean_caption(r) for r in references[i]] for i in ids])[0]


def eval_loader(shards: str, image_size: int, cfg: Config):
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_caption_eval_loader
    spec = LoaderSpec.evaluation(shards, cfg.eval.batch_size, cfg.eval.num_workers, rank=process_group.rank(),
                                 world_size=process_group.world_size())
    return build_caption_eval_loader(spec, image_size=image_size)


def evaluate_model(model: nn.Module, cfg: Config, tokenizer, shards: str, out: str, checkpoint: str = "",
                   extra: dict | None = None) -> dict:
    """Caption ``shards``, score with pycocoevalcap on rank 0, write the metrics JSON ``out`` and the
    predictions beside it. Returns the metrics (empty on other ranks)."""
    from mplug_pretrain.metrics.captions import check_java, score_captions, write_caption_results
    if cfg.eval.caption_metrics == "coco":
        check_java()  # before generating, not after
    device = next(model.parameters()).device
    model.eval()
    loader = eval_loader(shards, model.config.vision.image_size, cfg)
    settings = cfg.caption.generation
    predictions, references = gather_to_all(*generate_captions(model, loader, tokenizer, settings, device))
    metrics: dict = {}
    if process_group.rank() == 0:
        predictions_path = beside_metrics(out, "caption_predictions.json")
        write_caption_results(predictions, predictions_path)  # first: a scoring failure keeps the captions
        metrics = score_captions(predictions, references, cfg.eval.caption_metrics)
        report = {**metrics, **(extra or {}), "num_images": len(predictions), "shards": shards,
                  "checkpoint": checkpoint, "predictions": predictions_path, "generation": asdict(settings),
                  "caption_metrics": cfg.eval.caption_metrics}
        if cfg.eval.caption_metrics == "coco":
            report["spice"] = ("computed" if "SPICE" in metrics else "skipped: Stanford CoreNLP 3.6.0 jars missing "
                                                                      "from pycocoevalcap/spice/lib")
        write_metrics(out, report)
    process_group.barrier()
    return metrics


def run(cfg: Config, checkpoint: str, out: str | None = None) -> dict:
    """`mplug eval caption --config FILE --checkpoint DIR [--out FILE]` -> metrics dict."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.tasks.eval_inputs import require_inputs
    require_inputs("caption", cfg)
    shards = cfg.eval.shards or cfg.caption.val_shards
    model = load_eval_model(cfg, checkpoint)
    return evaluate_model(model, cfg, load_tokenizer(cfg.data.tokenizer), shards, metrics_path(cfg, "caption", out),
                          checkpoint=checkpoint)

"""`mplug bench scst-pass`: one SCST step (sampling, CIDEr-D reward, loss, backward) with the gradient taken
through the sampler itself (``one_pass``, models.generation.sample_with_grad) against sampling without gradient
then recomputing the log-probabilities by teacher forcing (``two_pass``); tasks/caption/scst.py.

Shape: the demo's SCST stage (configs/caption_demo.yaml): the tiny preset (random init) on cached ViT features of
32 real demo images (data_shards/caption, the first 32 of the training shards), prompt "a picture of", 5 samples
per image of at most 20 tokens, dropout off, CIDEr-D against the training references. Two vocabularies: BERT's
30,522 words and the demo's (data_shards/vocab: ``data.tokenizer``, ``model.text.vocab_size`` = its rows).
Then the same with the base preset (BERT's words), the captioner of real COCO fine-tuning.
Timing: one thread; rounds interleave the sides A/B/A/B after one untimed round each; round r seeds both sides
alike, so they draw the same captions and give the same loss (``max_loss_difference``). The optimizer step,
the same on both sides, is left out. Rows: preset, vocabulary, side, median and min seconds, ratio
two_pass / one_pass (above 1: one pass is faster). The machine's load average before and after is recorded.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from mplug_pretrain.bench.common import write_bench

SIDES = ("one_pass", "two_pass")
DEMO_ROOT = "data_shards"
DEMO_CONFIG = "configs/caption_demo.yaml"


def _setting(preset: str, vocab_folder: str | None, images: int):
    """(config, captioner, tokenizer, prompt ids, reward, batch with ViT features of ``images`` images)."""
    from mplug_pretrain.config import load_config
    from mplug_pretrain.data.reading.loader_spec import LoaderSpec
    from mplug_pretrain.data.reading.pipeline import build_loader
    from mplug_pretrain.data.tokenizer import load_tokenizer
    from mplug_pretrain.data.transforms import build_eval_transform
    from mplug_pretrain.tasks.caption.data import CaptionImageFormat, CaptionText, load_references, prompt_ids
    from mplug_pretrain.tasks.caption.model import captioner
    from mplug_pretrain.tasks.caption.scst import CiderDReward
    overrides = [f"model.preset={preset}"]
    if vocab_folder is not None:
        with open(os.path.join(vocab_folder, "vocab.txt"), encoding="utf-8") as f:
            overrides += [f"data.tokenizer={vocab_folder}", f"model.text.vocab_size={sum(1 for _ in f)}"]
    cfg = load_config(DEMO_CONFIG, overrides)
    c = cfg.caption
    torch.manual_seed(0)
    model = captioner(cfg.model).train()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    size = cfg.model.vision.image_size
    fmt = CaptionImageFormat(build_eval_transform(size), tokenizer, cfg.data.max_text_len, size,
                             CaptionText(c.generation.prompt))
    # pair layout, in shard order: the 2 captions of a scene are consecutive, so 2n rows hold n images
    batch = next(iter(build_loader(LoaderSpec.evaluation(c.train_shards, 2 * images), fmt)))
    assert len(set(batch["image_id"].tolist())) == images, "the demo's caption shards are not in scene order"
    with torch.no_grad():  # the demo's SCST stage reads cached features of the frozen ViT
        batch["features"] = model.image_encoder.vit(batch.pop("image"))
    reward = CiderDReward(load_references(cfg), sigma=c.scst_sigma, eos_in_reward=c.eos_in_reward)
    return cfg, model, tokenizer, prompt_ids(tokenizer, c.generation.prompt), reward, batch


def _step(setting, one_pass: bool, seed: int, quick: bool) -> tuple[float, float, float]:
    """-> (seconds of one SCST loss + backward, loss, mean sampled length)."""
    from mplug_pretrain.tasks.caption.losses import scst_batch_loss
    cfg, model, tokenizer, prompt, reward, batch = setting
    k, max_length = (2, 4) if quick else (cfg.caption.scst_samples, cfg.caption.generation.max_length)
    lengths = []
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = scst_batch_loss(model, batch, True, prompt, _recording(reward, lengths), tokenizer, k, max_length,
                          one_pass=one_pass)
    out["loss"].backward()
    return time.perf_counter() - start, out["loss"].item(), statistics.mean(lengths)


def _recording(reward, lengths: list):
    def score(image_ids, texts, finished):
        lengths.extend(len(t.split()) for t in texts)
        return reward(image_ids, texts, finished)
    return score


def _measure(setting, rounds: int, quick: bool) -> tuple[dict, float, dict]:
    """A/B/A/B rounds after one untimed round per side -> ({side: [seconds]}, max |loss difference|, lengths)."""
    times, lengths, worst = {side: [] for side in SIDES}, {side: [] for side in SIDES}, 0.0
    for r in range(rounds + 1):
        losses = {}
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            seconds, losses[side], length = _step(setting, side == "one_pass", seed=r, quick=quick)
            if r > 0:
                times[side].append(seconds)
                lengths[side].append(length)
        worst = max(worst, abs(losses["one_pass"] - losses["two_pass"]))
    return times, worst, {side: statistics.mean(v) for side, v in lengths.items()}


def run(out: str, quick: bool = False) -> dict:
    from mplug_pretrain.demo.shards import ensure_demo_shards
    ensure_demo_shards(DEMO_ROOT)
    vocab_folder = os.path.join(DEMO_ROOT, "vocab")
    if not os.path.isfile(os.path.join(vocab_folder, "vocab.txt")):
        raise FileNotFoundError(f"{vocab_folder}/vocab.txt: the demo vocabulary is missing (mplug_pretrain.demo)")
    # (preset, vocabulary, images, timed rounds per side): the demo's shape with both vocabularies, then the
    # base captioner that real COCO fine-tuning uses (fewer rounds: a step takes about a minute on one thread)
    settings = [("tiny", "bert", 32, 7), ("tiny", "demo", 32, 7), ("base", "bert", 32, 2)]
    if quick:
        settings = [("tiny", vocabulary, 2, 1) for vocabulary in ("bert", "demo")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine's noise matters less to one thread
    rows, load_before = [], os.getloadavg()
    try:
        for preset, vocabulary, images, rounds in settings:
            setting = _setting(preset, vocab_folder if vocabulary == "demo" else None, images)
            times, worst, lengths = _measure(setting, rounds, quick)
            medians = {side: statistics.median(t) for side, t in times.items()}
            for side in SIDES:
                rows.append({"preset": preset, "vocabulary": vocabulary, "vocab_size": setting[0].model.text.vocab_size,
                             "images": images, "side": side, "median_s": medians[side], "min_s": min(times[side]),
                             "rounds": rounds, "mean_sample_words": lengths[side], "max_loss_difference": worst,
                             "two_pass_over_one_pass": medians["two_pass"] / medians["one_pass"]})
                print(rows[-1], flush=True)
    finally:
        torch.set_num_threads(threads)
    return write_bench("scst-pass", rows, out, quick=quick, threads=1, config=DEMO_CONFIG,
                       load_average_before=load_before, load_average_after=os.getloadavg())

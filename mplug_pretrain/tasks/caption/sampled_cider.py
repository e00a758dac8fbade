"""Held-out expected CIDEr-D of sampled captions: the quantity SCST maximises, measured on images it never saw.

For each held-out image, k captions are sampled exactly as an SCST step samples them (``models.generation.
decoding.sample``: the full softmax, at most ``max_length`` tokens, EOS included) and each is scored by CIDEr-D
against that image's references (n = 4, sigma = 6, SacreEOS "standard", document frequencies from the
held-out references, one document per image: ``tasks.caption.scst.CiderDReward``). The result is the mean
over all N * k samples. It lives in tasks/caption/ beside the SCST reward it measures. Beam-search CIDEr-D
(``evaluate.fast_cider_d``) scores the mode of the caption distribution; this scores the distribution, so it
shows whether what SCST learned carries over to new images even where the mode has not moved yet.
"""
from __future__ import annotations

import torch
from torch import nn

from mplug_pretrain.data.tokenizer import tokenize
from mplug_pretrain.models.generation.decoding import sample
from mplug_pretrain.models.generation.packed_decoding import packed_for_decoding
from mplug_pretrain.tasks.caption.evaluate import gather_to_all
from mplug_pretrain.tasks.caption.scst import CiderDReward, decode_samples
from mplug_pretrain.utils import process_group


@torch.no_grad()
def sampled_cider_d(model: nn.Module, loader, tokenizer, prompt: str, device: torch.device, k: int = 5,
                    max_length: int = 20, seed: int = 0) -> float:
    """Mean CIDEr-D of k sampled captions per real image of ``loader`` (an ``eval_loader``: image, image_id,
    captions, is_pad). ``model`` should be in eval mode; draws come from a generator seeded by (seed, rank)."""
    generator = torch.Generator(device=device).manual_seed(seed * 1000 + process_group.rank())
    prompt_ids, prompt_mask = (t.to(device) for t in tokenize(tokenizer, [prompt], 512))
    samples, references = {}, {}  # (image_id, j) -> (text, finished)
    with packed_for_decoding(model.decoder) as decoder:  # weights fixed for the pass
        for batch in loader:
            keep = [i for i, pad in enumerate(batch["is_pad"].tolist()) if not pad]
            if not keep:
                continue
            n = len(keep)
            memory, memory_mask = model.memory(batch["image"][keep].to(device), prompt_ids.expand(n, -1),
                                               prompt_mask.expand(n, -1))
            sequences, _ = sample(decoder, memory, memory_mask, num_samples=k, max_length=max_length,
                                  generator=generator)
            texts, finished = decode_samples(tokenizer, sequences)
            image_ids = [int(batch["image_id"][i]) for i in keep]
            for i, image_id in zip(keep, image_ids):
                references[image_id] = list(batch["captions"][i])
            for row, (text, done) in enumerate(zip(texts, finished)):
                samples[(image_ids[row // k], row % k)] = (text, done)
    samples, references = gather_to_all(samples, references)
    if not samples:
        raise ValueError("sampled_cider_d: the loader gave no real image")
    keys = sorted(samples)
    ids = [image_id for image_id, _ in keys]
    texts, finished = zip(*(samples[key] for key in keys))
    return float(CiderDReward(references)(ids, texts, finished).mean())

"""Self-critical sequence training on CIDEr-D (Rennie et al. 2017; ExpansionNet v2 eq. 14, with Luo's
"average of the other samples" baseline, arXiv:2003.09971).

For each of the N images of a batch, k captions y_i1..y_ik are sampled from the model (multinomial on
the full softmax, at most ``max_length`` tokens, EOS included; ``models.generation.decoding.sample``), then

    r_ij = CIDEr-D(y_ij ; refs_i)               n = 4, sigma = 6, document frequencies from the TRAINING
                                                references (one document per training image)
    b_ij = (sum_l r_il - r_ij) / (k - 1)        mean reward of the OTHER samples of image i
    L    = -(1 / (N k)) sum_ij (r_ij - b_ij) * log p(y_ij | image_i)                      (eq. 14)

with log p the summed token log-probabilities (EOS included); the reward and the baseline carry no gradient.
log p comes either from the sampling pass itself, run with autograd on (``one_pass``, as ExpansionNet v2's
training: ``models.generation.decoding.sample_with_grad``), or (default) from a second, teacher-forced pass over the
samples drawn without gradient (``models.generation.decoding.sequence_log_probs``). Both give the same samples, loss and
gradient (tests/tasks/caption/test_caption_scst_one_pass.py). Either way an image is encoded once for its k samples
(``generation.expand_memory``: the BERT decoder also computes the memory's keys and values once per image).
One pass saves the recomputation but back-propagates through 20 single-token steps, each of which accumulates
every weight gradient and keeps its own copy of the growing key/value cache; two passes back-propagate once
through a batched forward. Measured (``mplug bench scst-pass``, bench/NOTES.md "SCST in one pass"), one pass
wins only where the output layer dominates (the tiny preset with BERT's 30,522 words); with the demo's small
vocabulary and at the base preset two passes are faster.
SacreEOS "standard" (signature STANDARD_wInit+Cider-D[n4,s6.0]+average[nspi5]): EOS is appended to every
reference and to every sample that emitted it (a sample cut at ``max_length`` has none).
Rewards compare words: references and decoded samples both go through ``tasks.caption.text.clean_caption``
(ExpansionNet v2's preprocessing: "man's" -> "man s").

The policy is the network with dropout OFF (``policy_mode``), in both modes: with two passes and dropout on, the
two would see different masks, so the gradient would push up log p of captions that a different network
sampled. On the demo's synthetic captions the dropout-free policy raised held-out CIDEr-D faster (bench/NOTES.md,
"SCST and dropout").
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from mplug_pretrain.metrics.cider_d import CiderD
from mplug_pretrain.models.decoders.api import EOS_ID
from mplug_pretrain.models.generation.decoding import (
    expand_memory,
    sample,
    sample_with_grad,
    sequence_log_probs,
    token_mask,
)
from mplug_pretrain.tasks.caption.text import clean_caption

EOS_WORD = "<eos>"  # never produced by clean_caption, so it cannot collide with a word
RewardFn = Callable[[Sequence[int], Sequence[str], Sequence[bool]], np.ndarray]


class CiderDReward:
    """r = CIDEr-D of sampled captions against the training references of their image.

    references: {image_id: [raw caption, ...]} of the TRAINING split (they also give the df).
    __call__(image_ids [M], captions [M] (decoded text), finished [M] (EOS emitted)) -> float64 [M]
    """

    def __init__(self, references: Mapping[int, Sequence[str]], sigma: float = 6.0, eos_in_reward: bool = True):
        if not references:
            raise ValueError("references: no training references for the CIDEr-D reward")
        self.index = {image_id: i for i, image_id in enumerate(references)}
        corpus = []
        for image_id, refs in references.items():
            cleaned = [clean_caption(r) for r in refs]
            if not any(cleaned):
                raise ValueError(f"references[{image_id!r}]: no non-empty reference caption")
            corpus.append(cleaned)
        self.scorer = CiderD(corpus, n=4, sigma=sigma, eos_mode="standard" if eos_in_reward else "none",
                             eos_token=EOS_WORD)

    def __call__(self, image_ids: Sequence[int], captions: Sequence[str], finished: Sequence[bool]) -> np.ndarray:
        missing = [i for i in image_ids if i not in self.index]
        if missing:
            raise KeyError(f"image_id {missing[0]!r} has no training references (the SCST reward needs them)")
        rows = [self.index[i] for i in image_ids]
        return self.scorer.score([clean_caption(c) for c in captions], rows, df="fixed",
                                 truncated=[not f for f in finished])


@contextmanager
def policy_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Every submodule in eval mode (dropout off) inside the block, each one's own mode restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training


def decode_samples(tokenizer, sequences: torch.Tensor) -> tuple[list[str], list[bool]]:
    """Sampled token rows [M, L] (first EOS included, PAD after) -> (texts, finished = emitted EOS)."""
    finished = (sequences == EOS_ID).any(1).tolist()
    kept = (sequences * token_mask(sequences)).tolist()
    return tokenizer.batch_decode(kept, skip_special_tokens=True), finished


def self_critical_loss(log_probs: torch.Tensor, rewards: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log_probs, rewards [N * k] (rows of image i: i*k .. i*k+k-1) -> (L, advantages r - b [N * k])."""
    if k < 2:
        raise ValueError(f"k: the leave-one-out baseline needs >= 2 samples per image, got {k}")
    if log_probs.shape != rewards.shape or log_probs.ndim != 1 or log_probs.shape[0] % k:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and rewards {tuple(rewards.shape)} must both be "
                         f"[N * k] with k = {k}")
    r = rewards.detach().to(log_probs.dtype).view(-1, k)
    baseline = (r.sum(1, keepdim=True) - r) / (k - 1)
    advantage = (r - baseline).view(-1)
    return -(advantage * log_probs).mean(), advantage


def scst_loss(decoder: nn.Module, memory: torch.Tensor, memory_mask: torch.Tensor, image_ids: Sequence[int],
              reward: RewardFn, tokenizer, k: int = 5, max_length: int = 20,
              one_pass: bool = False) -> dict[str, torch.Tensor]:
    """One SCST step for N images: memory [N, M, D] (with gradient) -> {"loss", "loss_reward" (mean r),
    "log_probs" [N * k] (with gradient), "sampled_log_probs" [N * k] (the sampler's, no gradient)}.
    one_pass: the sampler's own log-probs carry the gradient; else they are recomputed by teacher forcing.
    Call it inside ``policy_mode`` when the decoder has dropout (see the module docstring)."""
    if memory.shape[0] != len(image_ids):
        raise ValueError(f"memory has {memory.shape[0]} rows but {len(image_ids)} image ids were given")
    if one_pass:
        sequences, log_probs = sample_with_grad(decoder, memory, memory_mask, num_samples=k, max_length=max_length)
        sampled_log_probs = log_probs.detach()
    else:
        sequences, sampled_log_probs = sample(decoder, memory.detach(), memory_mask, num_samples=k,
                                              max_length=max_length)
        log_probs = sequence_log_probs(decoder, *expand_memory(decoder, memory, memory_mask, k), sequences)
    texts, finished = decode_samples(tokenizer, sequences)
    sample_ids = [i for i in image_ids for _ in range(k)]
    rewards = torch.as_tensor(reward(sample_ids, texts, finished), dtype=torch.float32, device=memory.device)
    loss, _ = self_critical_loss(log_probs, rewards, k)
    return {"loss": loss, "loss_reward": rewards.mean(), "log_probs": log_probs,
            "sampled_log_probs": sampled_log_probs}

"""Image-text (and video-text) retrieval, model side: embed every item once, rank by ITC, re-rank by ITM.

Two-stage protocol of mPLUG §5.2.3 (after ALBEF), used zero-shot for video in §5.4.2:
  1. unimodal embeddings: visual states V_i [L, D] and f_v,i = itc.image_features(V_i[0]) (a video's
     states and feature come from ``video_encoding``); text states T_j [T, D] and
     f_l,j = itc.text_features(pool(T_j)) (pool = [CLS] or masked mean, model.itc_pooling); ITC similarity s_ij = f_v,i . f_l,j (cosine, no temperature).
  2. for each visual item its k most ITC-similar texts, and for each text its k most similar visual
     items, are re-scored by ITM: itm_ij = itm_head(fuse(V_i, T_j)[text CLS])[1] (the "match" logit);
     the final score is itm_ij ("itm": ALBEF, mPLUG image retrieval) or itm_ij + s_ij ("itm+itc":
     BLIP/LAVIS, mPLUG video retrieval). Candidates outside a query's top-k never count as retrieved.
  ``score="itc"`` skips stage 2 and ranks by s_ij alone. Stage 2 fuses every pair some query asks for
  exactly once (a pair in an image's and a text's top-k is shared), ``batch_size`` pairs per forward; in a
  process group of R ranks each rank fuses 1/R of those pairs and the scores are all-gathered
  (``score_pairs_across_ranks``), so R ranks give the one-process figures in about 1/R of the time.
Recall@K (R@1/5/10, both directions, pessimistic ties) comes from ``metrics.retrieval_recall``.
Memory: every visual item's states stay on the model's device ([N, L, D]; COCO 5k at ViT-B/16 is
about 4 GB in fp32), as in the reference implementations, so the re-ranking never re-encodes images.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import comb
from typing import Literal

import numpy as np
import torch

from mplug_pretrain.metrics.retrieval_recall import rerank_topk, retrieval_recall
from mplug_pretrain.models.towers.text import pool_text

RerankScore = Literal["itc", "itm", "itm+itc"]
RERANK_SCORES = ("itc", "itm", "itm+itc")


@dataclass
class VisualBank:
    """Encoded images or videos: states [N, L, D] (L = 1+M per image, N_frames*(1+M) per video),
    ITC features [N, E]."""
    states: torch.Tensor
    features: torch.Tensor


@dataclass
class TextBank:
    """Encoded texts: states [N, T, D], mask [N, T] (right padded), ITC features [N, E]."""
    states: torch.Tensor
    mask: torch.Tensor
    features: torch.Tensor


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def embed_images(model, image_batches: Iterable[torch.Tensor]) -> VisualBank:
    """Image batches [B, 3, H, W] -> VisualBank (states [N, 1+M, D], features [N, E])."""
    device = model_device(model)
    states, features = [], []
    for images in image_batches:
        encoded = model.encode_image(images.to(device))
        states.append(encoded)
        features.append(model.itc.image_features(encoded[:, 0]).float())
    if not states:
        raise ValueError("embed_images: no images")
    return VisualBank(torch.cat(states), torch.cat(features))


@torch.no_grad()
def embed_texts(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch_size: int) -> TextBank:
    """Token ids / mask [N, T] (one padded tensor for all texts) -> TextBank, ``batch_size`` per forward."""
    if input_ids.shape[0] == 0:
        raise ValueError("embed_texts: no texts")
    device = model_device(model)
    states, features = [], []
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start:start + batch_size].to(device)
        mask = attention_mask[start:start + batch_size].to(device)
        encoded = model.encode_text(ids, mask)
        states.append(encoded)
        pooled = pool_text(encoded, mask, getattr(model.config, "itc_pooling", "cls"))
        features.append(model.itc.text_features(pooled).float())
    return TextBank(torch.cat(states), attention_mask.to(device), torch.cat(features))


@torch.no_grad()
def itm_match_scores(model, visual_states: torch.Tensor, text_states: torch.Tensor,
                     text_mask: torch.Tensor) -> torch.Tensor:
    """ITM "match" logits [P] of P (visual, text) pairs: states [P, L, D], [P, T, D], mask [P, T]."""
    length = int(text_mask.sum(1).max())  # drop the columns that are padding in every pair
    _, fused_text = model.fuse(visual_states, None, text_states[:, :length], text_mask[:, :length])
    return model.itm_head(fused_text[:, 0])[:, 1].float()


def score_pairs(model, visual: VisualBank, text: TextBank, visual_index: np.ndarray, text_index: np.ndarray,
                batch_size: int) -> np.ndarray:
    """ITM match logits of the pairs (visual_index[p], text_index[p]), ``batch_size`` pairs per forward."""
    device = visual.states.device
    v = torch.as_tensor(visual_index, dtype=torch.long, device=device)
    t = torch.as_tensor(text_index, dtype=torch.long, device=device)
    scores = [itm_match_scores(model, visual.states[v[s:s + batch_size]], text.states[t[s:s + batch_size]],
                               text.mask[t[s:s + batch_size]]) for s in range(0, len(v), batch_size)]
    return torch.cat(scores).cpu().numpy() if scores else np.zeros(0)


def score_pairs_across_ranks(model, visual: VisualBank, text: TextBank, visual_index: np.ndarray,
                             text_index: np.ndarray, batch_size: int) -> np.ndarray:
    """``score_pairs`` with the work split over the ranks of the process group (as the official retrieval
    evaluation splits its re-ranking): every rank holds the same banks and pair list, scores one contiguous
    slice of the pairs, and the slices are all-gathered in order, so every rank returns all P scores (equal to
    one process's). One process: ``score_pairs`` itself."""
    from mplug_pretrain.utils.process_group import rank, world_size
    ranks = world_size()
    if ranks == 1:
        return score_pairs(model, visual, text, visual_index, text_index, batch_size)
    import torch.distributed as dist
    bounds = np.linspace(0, len(visual_index), ranks + 1).astype(np.int64)
    lo, hi = bounds[rank()], bounds[rank() + 1]
    mine = torch.as_tensor(score_pairs(model, visual, text, visual_index[lo:hi], text_index[lo:hi], batch_size),
                           dtype=torch.float64)
    device = visual.states.device if dist.get_backend() == "nccl" else torch.device("cpu")
    longest = int(np.diff(bounds).max())
    padded = torch.zeros(longest, dtype=torch.float64, device=device)
    padded[:hi - lo] = mine.to(device)
    slices = [torch.zeros_like(padded) for _ in range(ranks)]
    dist.all_gather(slices, padded)
    return torch.cat([part[:n] for part, n in zip(slices, np.diff(bounds).tolist())]).cpu().numpy()


def precomputed_itm(model, visual: VisualBank, text: TextBank, itc: np.ndarray, k: int, batch_size: int,
                    across_ranks: bool = False):
    """``itm_score(visual_indices, text_indices) -> [P]`` for ``retrieval_metrics.rerank_topk``, answered from
    scores computed up front: every pair re-ranking will ask for (each query's top-k, chosen by the same
    stable argsort) is scored once, in large batches; a pair in an image's and a text's top-k is shared.
    ``across_ranks``: every rank of the process group calls this with the same banks, and each scores its share
    (``score_pairs_across_ranks``); else this process scores all (also when other ranks are idle)."""
    num_visual, num_text = itc.shape
    wanted = [np.argsort(-itc[i], kind="stable")[:k] + i * num_text for i in range(num_visual)]
    wanted += [np.argsort(-itc[:, j], kind="stable")[:k] * num_text + j for j in range(num_text)]
    keys = np.unique(np.concatenate(wanted))
    score = score_pairs_across_ranks if across_ranks else score_pairs
    scores = score(model, visual, text, keys // num_text, keys % num_text, batch_size)

    def itm_score(visual_index: np.ndarray, text_index: np.ndarray) -> np.ndarray:
        visual_index = np.asarray(visual_index, dtype=np.int64)
        text_index = np.asarray(text_index, dtype=np.int64)
        query = visual_index * num_text + text_index
        at = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
        found = keys[at] == query
        out = scores[at].copy()
        if not found.all():  # not expected (same selection rule); scored directly (by this rank) rather than guessed
            missing = ~found
            out[missing] = score_pairs(model, visual, text, visual_index[missing], text_index[missing],
                                       batch_size)
        return out
    return itm_score


def itc_similarity(visual: VisualBank, text: TextBank) -> np.ndarray:
    """s [N_visual, N_text] = f_v f_l^T (float64)."""
    return (visual.features.float() @ text.features.float().t()).double().cpu().numpy()


def score_matrices(model, visual: VisualBank, text: TextBank, k: int, score: RerankScore,
                   batch_size: int = 64, across_ranks: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(itc [Nv, Nt], visual->text scores, text->visual scores), the last two after re-ranking
    (both equal ``itc`` when ``score == "itc"``)."""
    if score not in RERANK_SCORES:
        raise ValueError(f"score: expected one of {RERANK_SCORES}, got {score!r}")
    itc = itc_similarity(visual, text)
    if score == "itc":
        return itc, itc, itc
    v2t, t2v = rerank_topk(itc, k, precomputed_itm(model, visual, text, itc, k, batch_size, across_ranks),
                           score=score)
    return itc, v2t, t2v


def evaluate_retrieval(model, visual: VisualBank, text: TextBank, text_to_visual: Sequence[int], k: int,
                       score: RerankScore, batch_size: int = 64, visual_name: str = "img",
                       across_ranks: bool = False) -> dict:
    """Recall@1/5/10 both ways. Keys: ``txt_r1`` .. (visual -> text), ``{visual_name}_r1`` .. (text ->
    visual), ``r_mean``; re-ranked metrics at the top level, the ITC-only ones under ``"itc"``, the
    expected values of a random ranking under ``"chance"``. ``across_ranks``: see ``precomputed_itm``."""
    if visual.features.shape[0] != max(text_to_visual, default=-1) + 1:
        raise ValueError(f"text_to_visual names {max(text_to_visual, default=-1) + 1} visual items, "
                         f"the bank holds {visual.features.shape[0]}")
    itc, v2t, t2v = score_matrices(model, visual, text, k, score, batch_size, across_ranks)

    def rename(recalls: dict) -> dict:
        return {key.replace("img_", f"{visual_name}_"): value for key, value in recalls.items()}

    out = rename(retrieval_recall(v2t, text_to_visual, t2v))
    out["itc"] = rename(retrieval_recall(itc, text_to_visual))
    out["chance"] = chance_recall(text_to_visual, visual_name=visual_name)
    out["rerank_score"], out["k_test"] = score, (None if score == "itc" else k)
    return out


def chance_recall(text_to_visual: Sequence[int], ks: Sequence[int] = (1, 5, 10),
                  visual_name: str = "img") -> dict[str, float]:
    """Expected recall@K (%) of a uniformly random ranking, same keys as ``retrieval_recall``.

    visual -> text: item i with n_i of the N_t texts correct: 1 - C(N_t - n_i, K) / C(N_t, K);
    text -> visual: min(K, N_v) / N_v.
    """
    t2v = np.asarray(text_to_visual, dtype=np.int64)
    num_texts, per_visual = len(t2v), np.bincount(t2v)
    num_visual = len(per_visual)
    out: dict[str, float] = {}
    for k in ks:
        top = min(k, num_texts)
        hits = [1.0 - comb(num_texts - n, top) / comb(num_texts, top) for n in per_visual]
        out[f"txt_r{k}"] = 100.0 * float(np.mean(hits))
        out[f"{visual_name}_r{k}"] = 100.0 * min(k, num_visual) / num_visual
    return out

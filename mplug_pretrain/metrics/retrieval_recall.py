"""Image-text retrieval: recall@K from score matrices, and ITC top-k + ITM re-ranking.

Scores are [N_img, N_txt] (higher = more similar); ``text_to_image[j]`` is the one image of text j
(every image has >= 1 text, e.g. 5 for COCO/Flickr30K). Following ALBEF/BLIP/mPLUG naming:
- ``txt_r@K`` (image -> text retrieval): an image is a hit when its best-ranked ground-truth text
  is among its top K texts;
- ``img_r@K`` (text -> image retrieval): a text is a hit when its image is among its top K images.
Recalls are percentages; ``r_mean`` averages the six of R@1/5/10. ``*_medr`` / ``*_meanr``: the median / mean
1-based rank of the ground truth (MedR / MeanR, lower is better; a ground truth outside a re-ranked top-k ranks
after every candidate scored above it).

Ties are counted pessimistically: the ground truth ranks after every other candidate with an equal
score (rank = #{other candidates with score >= ground-truth score}, 0-based). A constant scorer
therefore gets chance-level recall, never 100%, and candidates outside a re-ranked top-k
(score ``-inf``) never count as retrieved. NaN scores are an error.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

ItmScore = Callable[[np.ndarray, np.ndarray], "np.ndarray"]

_ROW_CHUNK = 256  # rows compared at once: bounds the boolean temporaries to chunk x N


def _check(scores: np.ndarray, text_to_image: np.ndarray, name: str) -> None:
    if scores.ndim != 2:
        raise ValueError(f"{name}: expected [N_img, N_txt], got shape {scores.shape}")
    if text_to_image.shape != (scores.shape[1],):
        raise ValueError(f"text_to_image: {text_to_image.shape[0]} entries for {scores.shape[1]} texts in {name}")
    if text_to_image.min(initial=0) < 0 or text_to_image.max(initial=0) >= scores.shape[0]:
        raise ValueError(f"text_to_image: image indices must be in [0, {scores.shape[0]})")
    if np.isnan(scores).any():
        raise ValueError(f"{name}: contains NaN")
    without_text = np.flatnonzero(np.bincount(text_to_image, minlength=scores.shape[0]) == 0)
    if len(without_text):
        raise ValueError(f"text_to_image: image {int(without_text[0])} has no text ({len(without_text)} such images)")


def image_to_text_ranks(scores: np.ndarray, text_to_image: Sequence[int] | np.ndarray) -> np.ndarray:
    """0-based pessimistic rank of each image's best ground-truth text. int64 [N_img]."""
    scores, t2i = np.asarray(scores, dtype=np.float64), np.asarray(text_to_image, dtype=np.int64)
    _check(scores, t2i, "scores")
    gt_score = scores[t2i, np.arange(len(t2i))]
    best = np.full(scores.shape[0], -np.inf)
    np.maximum.at(best, t2i, gt_score)
    # ground-truth texts tied with the best one are not competitors
    gt_at_best = np.bincount(t2i, weights=(gt_score == best[t2i]), minlength=scores.shape[0])
    at_least = np.concatenate([(scores[i:i + _ROW_CHUNK] >= best[i:i + _ROW_CHUNK, None]).sum(1)
                               for i in range(0, scores.shape[0], _ROW_CHUNK)])
    return (at_least - gt_at_best).astype(np.int64)


def text_to_image_ranks(scores: np.ndarray, text_to_image: Sequence[int] | np.ndarray) -> np.ndarray:
    """0-based pessimistic rank of each text's image. int64 [N_txt]."""
    scores, t2i = np.asarray(scores, dtype=np.float64), np.asarray(text_to_image, dtype=np.int64)
    _check(scores, t2i, "scores")
    by_text = scores.T
    gt_score = by_text[np.arange(len(t2i)), t2i]
    at_least = np.concatenate([(by_text[j:j + _ROW_CHUNK] >= gt_score[j:j + _ROW_CHUNK, None]).sum(1)
                               for j in range(0, len(t2i), _ROW_CHUNK)])
    return (at_least - 1).astype(np.int64)


def retrieval_recall(i2t_scores: np.ndarray, text_to_image: Sequence[int] | np.ndarray,
                     t2i_scores: np.ndarray | None = None, ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """{"txt_r1", "txt_r5", "txt_r10", "txt_r_mean", "img_r1", ..., "img_r_mean", "r_mean"} in %, and
    {"txt_medr", "txt_meanr", "img_medr", "img_meanr"} (ranks).

    ``t2i_scores`` (same [N_img, N_txt] layout) defaults to ``i2t_scores``; they differ after
    re-ranking, which scores each direction's own top-k.
    """
    txt_ranks = image_to_text_ranks(i2t_scores, text_to_image)
    img_ranks = text_to_image_ranks(i2t_scores if t2i_scores is None else t2i_scores, text_to_image)
    out: dict[str, float] = {}
    for prefix, ranks in (("txt", txt_ranks), ("img", img_ranks)):
        for k in ks:
            out[f"{prefix}_r{k}"] = 100.0 * float(np.mean(ranks < k))
        out[f"{prefix}_r_mean"] = float(np.mean([out[f"{prefix}_r{k}"] for k in ks]))
    out["r_mean"] = (out["txt_r_mean"] + out["img_r_mean"]) / 2
    for prefix, ranks in (("txt", txt_ranks), ("img", img_ranks)):  # 1-based ranks of the ground truth
        out[f"{prefix}_medr"], out[f"{prefix}_meanr"] = float(np.median(ranks + 1)), float(np.mean(ranks + 1))
    return out


def _as_numpy(values, expected: int, what: str) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor, possibly on GPU
        values = values.detach().float().cpu().numpy()
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if values.shape != (expected,):
        raise ValueError(f"itm_score returned {values.shape[0]} scores for {expected} pairs ({what})")
    return values


def rerank_topk(itc_scores: np.ndarray, k: int, itm_score: ItmScore,
                score: Literal["itm", "itm+itc"] = "itm", floor: float = -np.inf) -> tuple[np.ndarray, np.ndarray]:
    """ITC top-k then ITM re-ranking (mPLUG/ALBEF/BLIP retrieval evaluation).

    For each image, its k texts with the highest ITC score are re-scored by
    ``itm_score(image_indices, text_indices) -> [k]`` (e.g. the ITM head's match logit); for each
    text likewise its k images. ``score``: "itm" (ALBEF, mPLUG image retrieval) or "itm+itc"
    (BLIP/LAVIS, mPLUG video retrieval: ITM score + ITC similarity). Entries outside a query's
    top-k get ``floor``. Top-k ties keep the lower index. Returns (i2t, t2i), both [N_img, N_txt],
    ready for :func:`retrieval_recall`.
    """
    itc = np.asarray(itc_scores, dtype=np.float64)
    if itc.ndim != 2:
        raise ValueError(f"itc_scores: expected [N_img, N_txt], got shape {itc.shape}")
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    if score not in ("itm", "itm+itc"):
        raise ValueError(f"score: expected 'itm' or 'itm+itc', got {score!r}")
    num_img, num_txt = itc.shape
    i2t = np.full_like(itc, floor)
    t2i = np.full_like(itc, floor)
    for i in range(num_img):
        top = np.argsort(-itc[i], kind="stable")[:k]
        s = _as_numpy(itm_score(np.full(len(top), i), top), len(top), f"image {i}")
        i2t[i, top] = s + itc[i, top] if score == "itm+itc" else s
    for j in range(num_txt):
        top = np.argsort(-itc[:, j], kind="stable")[:k]
        s = _as_numpy(itm_score(top, np.full(len(top), j)), len(top), f"text {j}")
        t2i[top, j] = s + itc[top, j] if score == "itm+itc" else s
    return i2t, t2i

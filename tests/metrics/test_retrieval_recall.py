"""Recall@K against a brute-force sort with pessimistic ties; ITC top-k + ITM re-ranking."""
import numpy as np
import pytest

from mplug_pretrain.metrics.retrieval_recall import (
    image_to_text_ranks,
    rerank_topk,
    retrieval_recall,
    text_to_image_ranks,
)


def brute_ranks(scores, text_to_image):
    num_img, num_txt = scores.shape
    txt = []
    for i in range(num_img):
        # equal scores: the non-ground-truth candidates come first (pessimistic)
        order = sorted(range(num_txt), key=lambda j: (-scores[i, j], text_to_image[j] == i))
        txt.append(next(pos for pos, j in enumerate(order) if text_to_image[j] == i))
    img = []
    for j in range(num_txt):
        order = sorted(range(num_img), key=lambda i: (-scores[i, j], i == text_to_image[j]))
        img.append(order.index(text_to_image[j]))
    return np.array(txt), np.array(img)


def brute_recall(scores, text_to_image, ks=(1, 5, 10)):
    txt, img = brute_ranks(scores, text_to_image)
    out = {}
    for name, ranks in (("txt", txt), ("img", img)):
        for k in ks:
            out[f"{name}_r{k}"] = 100.0 * np.mean(ranks < k)
        out[f"{name}_r_mean"] = np.mean([out[f"{name}_r{k}"] for k in ks])
    out["r_mean"] = (out["txt_r_mean"] + out["img_r_mean"]) / 2
    for name, ranks in (("txt", txt), ("img", img)):  # MedR / MeanR: 1-based position in the sorted candidates
        positions = sorted(int(r) + 1 for r in ranks)
        middle = len(positions) // 2
        out[f"{name}_medr"] = (positions[middle] if len(positions) % 2
                               else (positions[middle - 1] + positions[middle]) / 2)
        out[f"{name}_meanr"] = sum(positions) / len(positions)
    return out


def random_case(seed, num_img=24, levels=None):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 6, size=num_img)
    text_to_image = rng.permutation(np.repeat(np.arange(num_img), counts))
    shape = (num_img, len(text_to_image))
    # few distinct values -> many ties
    scores = rng.integers(0, levels, size=shape).astype(float) if levels else rng.normal(size=shape)
    return scores, text_to_image


@pytest.mark.parametrize("seed,levels", [(0, None), (1, 3), (2, 6), (3, 2)])
def test_recall_matches_brute_force(seed, levels):
    scores, t2i = random_case(seed, levels=levels)
    txt, img = brute_ranks(scores, t2i)
    np.testing.assert_array_equal(image_to_text_ranks(scores, t2i), txt)
    np.testing.assert_array_equal(text_to_image_ranks(scores, t2i), img)
    ours, expected = retrieval_recall(scores, t2i), brute_recall(scores, t2i)
    assert ours.keys() == expected.keys()
    for key in expected:
        assert ours[key] == pytest.approx(expected[key]), key


def test_constant_and_perfect_scorers():
    t2i = np.repeat(np.arange(15), 5)
    assert retrieval_recall(np.zeros((15, 75)), t2i)["r_mean"] == 0.0
    perfect = (t2i[None, :] == np.arange(15)[:, None]).astype(float)
    assert retrieval_recall(perfect, t2i)["r_mean"] == 100.0


def test_separate_direction_matrices():
    scores, t2i = random_case(5)
    other = np.random.default_rng(6).normal(size=scores.shape)
    mixed = retrieval_recall(scores, t2i, t2i_scores=other)
    assert mixed["txt_r1"] == retrieval_recall(scores, t2i)["txt_r1"]
    assert mixed["img_r1"] == retrieval_recall(other, t2i)["img_r1"]


@pytest.mark.parametrize("score", ["itm", "itm+itc"])
def test_rerank_topk_against_brute_force(score):
    rng = np.random.default_rng(7)
    itc = rng.integers(0, 5, size=(9, 20)).astype(float)  # ties in the top-k selection
    itm = rng.normal(size=(9, 20))
    calls = []

    def itm_score(images, texts):
        calls.append(len(images))
        return itm[images, texts]

    k = 4
    i2t, t2i = rerank_topk(itc, k, itm_score, score=score)
    expected_i2t = np.full_like(itc, -np.inf)
    for i in range(9):
        top = sorted(range(20), key=lambda j: (-itc[i, j], j))[:k]
        expected_i2t[i, top] = itm[i, top] + (itc[i, top] if score == "itm+itc" else 0)
    expected_t2i = np.full_like(itc, -np.inf)
    for j in range(20):
        top = sorted(range(9), key=lambda i: (-itc[i, j], i))[:k]
        expected_t2i[top, j] = itm[top, j] + (itc[top, j] if score == "itm+itc" else 0)
    np.testing.assert_array_equal(i2t, expected_i2t)
    np.testing.assert_array_equal(t2i, expected_t2i)
    assert calls == [k] * (9 + 20)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="image 2 has no text"):
        retrieval_recall(np.zeros((3, 2)), [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        retrieval_recall(np.full((2, 2), np.nan), [0, 1])
    with pytest.raises(ValueError, match="returned 1 scores"):
        rerank_topk(np.zeros((2, 3)), 2, lambda i, t: np.zeros(1))

"""Our CIDEr-D against pycocoevalcap's CiderScorer (the reference implementation) to 1e-9."""
import random

import numpy as np
import pytest
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.cider.cider_scorer import CiderScorer

from mplug_pretrain.metrics.cider_d import CiderD, cider_d

TOL = 1e-9

REAL_REFS = [
    ["a man riding a wave on top of a surfboard", "a surfer rides a large wave in the ocean",
     "a person on a surfboard riding a wave", "a man surfing on a big blue wave",
     "surfer in a black wetsuit riding a wave"],
    ["two giraffes standing next to each other in a field", "a pair of giraffes in a grassy enclosure",
     "two tall giraffes near some trees", "giraffes standing in the grass on a sunny day",
     "two giraffes are eating leaves from a tree"],
    ["a plate of food with broccoli and rice", "a white plate topped with meat and vegetables",
     "a meal of chicken broccoli and rice on a plate", "a close up of a plate of food",
     "a dinner plate with broccoli rice and meat"],
    ["a red double decker bus driving down a street", "a bus is parked on the side of the road",
     "a large red bus on a city street", "a double decker bus stopped at a bus stop",
     "the red bus is driving past some buildings"],
    ["a cat laying on top of a laptop computer", "a cat sleeping on a keyboard",
     "a grey cat curled up on a laptop", "a kitten resting on an open laptop",
     "a cat lies on the keys of a computer"],
    ["a kitchen with wooden cabinets and a stove", "a small kitchen with a white refrigerator",
     "an empty kitchen with a sink and an oven", "a kitchen area with cabinets and appliances",
     "a clean kitchen with a microwave above the stove"],
]
REAL_HYPS = ["a man riding a wave on a surfboard", "two giraffes standing in a field",
             "a plate of food with broccoli", "a red bus driving down a street",
             "a cat cat cat cat cat", "the"]


def pyco_one_per_image(hyps, refs):
    return np.asarray(Cider().compute_score({i: r for i, r in enumerate(refs)},
                                            {i: [h] for i, h in enumerate(hyps)})[1])


def pyco_entries(pairs, n=4, sigma=6.0):
    scorer = CiderScorer(n=n, sigma=sigma)
    for hyp, refs in pairs:
        scorer += (hyp, refs)
    return np.asarray(scorer.compute_score()[1])


def random_corpus(seed, num_images=30, vocab=25):
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]

    def caption(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    refs = [[caption(1, 12) for _ in range(rng.randint(1, 6))] for _ in range(num_images)]
    hyps = [caption(0, 14) for _ in range(num_images)]
    hyps[0] = ""                                # empty
    hyps[1] = "zebra unicorn quokka"             # no overlap with any reference
    hyps[2] = " ".join([words[1]] * 7)           # one word repeated
    hyps[3] = words[2]                           # a single word (0 bigrams: length quirk)
    hyps[4] = refs[4][0]                         # exact copy of a reference
    return refs, hyps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_inputs_equal_pycocoevalcap(seed):
    refs, hyps = random_corpus(seed)
    mean, ours = cider_d(hyps, refs)
    theirs = pyco_one_per_image(hyps, refs)
    assert np.abs(ours - theirs).max() < TOL
    assert abs(mean - theirs.mean()) < TOL
    assert ours[0] == 0.0 and ours[1] == 0.0


def test_real_text_equal_pycocoevalcap():
    _, ours = cider_d(REAL_HYPS, REAL_REFS)
    theirs = pyco_one_per_image(REAL_HYPS, REAL_REFS)
    assert np.abs(ours - theirs).max() < TOL
    assert ours[0] > ours[4] > 0  # sanity: the good caption beats the degenerate one


@pytest.mark.parametrize("sigma", [3.0, 10.0])
def test_other_sigmas(sigma):
    # pycocoevalcap's scorer only works with n=4 (cook_refs ignores its n), so only sigma varies
    refs, hyps = random_corpus(7)
    ours = CiderD(refs, sigma=sigma).score(hyps, np.arange(len(hyps)), df="corpus")
    theirs = pyco_entries(list(zip(hyps, refs)), sigma=sigma)
    assert np.abs(ours - theirs).max() < TOL


def k_samples(seed, refs, k=5):
    rng = random.Random(seed)
    words = sorted({w for r in refs for c in r for w in c.split()}) + ["oov1", "oov2"]
    hyps = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 12))) for _ in range(len(refs) * k)]
    return hyps, np.repeat(np.arange(len(refs)), k)


def test_k_samples_batch_df_equals_per_batch_scorer():
    refs, _ = random_corpus(3)
    hyps, index = k_samples(3, refs)
    scorer = CiderD(refs)
    ours = scorer.score(hyps, index, df="corpus")
    theirs = pyco_entries([(h, refs[i]) for h, i in zip(hyps, index)])
    assert np.abs(ours - theirs).max() < TOL
    # an SCST batch: a few images of the corpus, in any order
    batch = np.array([7, 7, 2, 29, 2, 0])
    sel = [int(np.flatnonzero(index == i)[j % 5]) for j, i in enumerate(batch)]
    ours_batch = scorer.score([hyps[t] for t in sel], batch, df="corpus")
    theirs_batch = pyco_entries([(hyps[t], refs[i]) for t, i in zip(sel, batch)])
    assert np.abs(ours_batch - theirs_batch).max() < TOL


def test_fixed_df_equals_pycocoevalcap_one_hypothesis_per_image():
    # with one hypothesis per image over the whole corpus, pycocoevalcap's df is the corpus df
    refs = REAL_REFS + random_corpus(5, num_images=10)[0]
    hyps, index = k_samples(5, refs, k=3)
    scorer = CiderD(refs)
    ours = scorer.score(hyps, index, df="fixed")
    expected = np.zeros(len(hyps))
    for j in range(3):
        expected[j::3] = pyco_one_per_image(hyps[j::3], refs)
    assert np.abs(ours - expected).max() < TOL
    # scoring a subset (a training batch) does not change the fixed-df scores
    subset = [14, 2, 40, 3]
    assert np.abs(scorer.score([hyps[t] for t in subset], index[subset]) - expected[subset]).max() < TOL


def test_standard_eos_equals_appending_the_token():
    refs, hyps = random_corpus(11)
    scorer = CiderD(refs, eos_mode="standard", eos_token="<eos>")
    truncated = np.zeros(len(hyps), dtype=bool)
    truncated[5] = True
    ours = scorer.score(hyps, np.arange(len(hyps)), df="corpus", truncated=truncated)
    eos_refs = [[r + " <eos>" for r in rs] for rs in refs]
    eos_hyps = [h if t else (h + " <eos>").strip() for h, t in zip(hyps, truncated)]
    theirs = pyco_one_per_image(eos_hyps, eos_refs)
    assert np.abs(ours - theirs).max() < TOL
    plain = CiderD(refs).score(hyps, np.arange(len(hyps)), df="corpus")
    assert np.abs(ours - plain).max() > 1e-3  # the option does change the scores


def test_token_id_sequences_equal_strings():
    refs, hyps = random_corpus(13)
    as_ids = lambda c: [int(w[1:]) if w.startswith("w") else 10_000 + len(w) for w in c.split()]
    ours_ids = CiderD([[as_ids(r) for r in rs] for rs in refs]).score(
        [np.array(as_ids(h), dtype=np.int64) for h in hyps], np.arange(len(hyps)))
    ours_str = CiderD(refs).score(hyps, np.arange(len(hyps)))
    assert np.abs(ours_ids - ours_str).max() < TOL


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"refs\[1\]"):
        CiderD([["a b"], []])
    scorer = CiderD([["a b c"], ["d e f"]])
    with pytest.raises(ValueError, match="image_index: 5"):
        scorer.score(["a b"], [5])
    with pytest.raises(ValueError, match="image_index: 2 entries"):
        scorer.score(["a b"], [0, 1])


def test_batch_without_any_shared_ngram_equals_pycocoevalcap():
    """Regression: with no hit at all numpy's bincount returned ints and the division failed."""
    hyps, refs = ["a b c", "x y"], [["d e f", "g h"], ["p q r s"]]
    ours, ours_scores = cider_d(hyps, refs)
    theirs, theirs_scores = Cider().compute_score({i: r for i, r in enumerate(refs)},
                                                  {i: [h] for i, h in enumerate(hyps)})
    assert ours == pytest.approx(theirs, abs=1e-12) and ours == 0.0
    np.testing.assert_allclose(ours_scores, theirs_scores, atol=1e-12)

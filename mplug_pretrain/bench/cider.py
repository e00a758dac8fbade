"""Bench: our CIDEr-D (``metrics.cider_d.CiderD``) against pycocoevalcap's ``CiderScorer`` as an
SCST reward: 5,000 images x 5 references x 5 sampled captions (25,000 hypotheses, each scored
against the references of its image), in batches of 50 images (250 hypotheses) like a training
step. Captions are synthetic but COCO-like (8-15 words from a fixed vocabulary, seeded; the
references and samples of one image share a scene, so n-grams overlap as in real data).

Rows (``implementation``, ``df``, ``seconds``, ``max_abs_diff``):
- df "batch": document frequencies from the scored batch, what a per-batch
  ``CiderScorer`` computes; ours uses ``score(..., df="corpus")`` on a scorer built once.
- df "training refs": document frequencies from all references (the SCST setting, ours
  ``df="fixed"``); pycocoevalcap computes the same numbers when it scores one hypothesis per
  image over the whole corpus, so it is run once per sample index (5 calls of 5,000).
``max_abs_diff`` compares the 25,000 scores of our row with the pycocoevalcap row of the same df.
``quick=True``: 200 images.
"""
from __future__ import annotations

import random
import time

import numpy as np

from mplug_pretrain.bench.common import median_seconds, write_bench
from mplug_pretrain.metrics.cider_d import CiderD

SUBJECTS = ["man", "woman", "dog", "cat", "child", "boy", "girl", "bus", "train", "bird", "horse", "giraffe",
            "elephant", "skateboarder", "surfer", "zebra", "pizza", "motorcycle", "teddy bear", "couple"]
ADJECTIVES = ["small", "large", "white", "black", "red", "young", "old", "brown", "wooden", "green", "tall", "little"]
VERBS = ["sitting on", "standing next to", "riding", "walking down", "holding", "looking at", "laying on",
         "flying over", "eating", "parked near", "jumping over", "playing with"]
PLACES = ["street", "beach", "table", "field", "kitchen", "bench", "grass", "snow", "water", "road", "building",
          "fence", "wave", "plate", "sidewalk", "bed"]
EXTRAS = ["in the background", "on a sunny day", "with a frisbee", "near the water", "in front of a building",
          "at night", "under a tree", "next to a car", "in a park", "on the side of the road"]


def _caption(rng: random.Random, scene: dict, noise: float) -> str:
    def pick(options: list[str], own: str) -> str:
        return rng.choice(options) if rng.random() < noise else own

    words = []
    if rng.random() < 0.7:
        words.append(pick(ADJECTIVES, scene["adjective"]))
    words += pick(SUBJECTS, scene["subject"]).split()
    words.insert(0, "an" if words[0][0] in "aeiou" else "a")
    words += pick(VERBS, rng.choice(scene["verbs"])).split()
    words += [rng.choice(["a", "the"])] + pick(PLACES, scene["place"]).split()
    while len(words) < 8 or (len(words) < 15 and rng.random() < 0.4):
        words += pick(EXTRAS, rng.choice(scene["extras"])).split()
    return " ".join(words[:15])


def synthetic_captions(num_images: int, refs_per_image: int, samples_per_image: int,
                       seed: int = 0) -> tuple[list[list[str]], list[str]]:
    """(references per image, samples flattened image-major) with a fixed seed."""
    rng = random.Random(seed)
    refs, samples = [], []
    for _ in range(num_images):
        scene = {"subject": rng.choice(SUBJECTS), "adjective": rng.choice(ADJECTIVES), "place": rng.choice(PLACES),
                 "verbs": rng.sample(VERBS, 2), "extras": rng.sample(EXTRAS, 3)}
        refs.append([_caption(rng, scene, noise=0.15) for _ in range(refs_per_image)])
        samples += [_caption(rng, scene, noise=0.35) for _ in range(samples_per_image)]
    return refs, samples


def _pycocoevalcap_scores(pairs: list[tuple[str, list[str]]]) -> np.ndarray:
    from pycocoevalcap.cider.cider_scorer import CiderScorer

    scorer = CiderScorer(n=4, sigma=6.0)
    for hyp, image_refs in pairs:
        scorer += (hyp, image_refs)
    return np.asarray(scorer.compute_score()[1], dtype=np.float64)


def run(out: str, quick: bool = False) -> dict:
    num_images, refs_per_image, samples, batch_images = (200 if quick else 5000), 5, 5, 50
    refs, hyps = synthetic_captions(num_images, refs_per_image, samples)
    image_index = np.repeat(np.arange(num_images), samples)
    batches = [slice(b * samples, (b + batch_images) * samples) for b in range(0, num_images, batch_images)]

    results: dict[str, np.ndarray] = {}

    def pyco_batch():
        results["pyco_batch"] = np.concatenate(
            [_pycocoevalcap_scores([(hyps[t], refs[image_index[t]]) for t in range(s.start, s.stop)]) for s in batches])

    def pyco_train_df():
        scores = np.zeros(len(hyps))
        for j in range(samples):
            scores[j::samples] = _pycocoevalcap_scores([(hyps[i * samples + j], refs[i]) for i in range(num_images)])
        results["pyco_train"] = scores

    start = time.perf_counter()
    scorer = CiderD(refs)
    build_seconds = time.perf_counter() - start

    def ours(df: str):
        def fn():
            results[f"ours_{df}"] = np.concatenate(
                [scorer.score(hyps[s], image_index[s], df=df) for s in batches])
        return fn

    rows = []
    timed = [("pycocoevalcap CiderScorer", "batch", pyco_batch, "pyco_batch", None, 1),
             ("mplug_pretrain CiderD", "batch", ours("corpus"), "ours_corpus", "pyco_batch", 3),
             ("pycocoevalcap CiderScorer", "training refs", pyco_train_df, "pyco_train", None, 1),
             ("mplug_pretrain CiderD", "training refs", ours("fixed"), "ours_fixed", "pyco_train", 3)]
    for implementation, df, fn, key, reference, repeats in timed:
        seconds = median_seconds(fn, repeats=repeats, warmup=0 if repeats == 1 else 1)
        diff = None if reference is None else float(np.abs(results[key] - results[reference]).max())
        rows.append({"implementation": implementation, "df": df, "seconds": seconds,
                     "hypotheses_per_second": len(hyps) / seconds, "max_abs_diff": diff})
    rows.append({"implementation": "mplug_pretrain CiderD (build from references, once)", "df": "training refs",
                 "seconds": build_seconds, "hypotheses_per_second": None, "max_abs_diff": None})
    for ours_row, pyco_row in ((rows[1], rows[0]), (rows[3], rows[2])):
        ours_row["speedup_vs_pycocoevalcap"] = pyco_row["seconds"] / ours_row["seconds"]
    return write_bench("cider", rows, out, quick=quick, num_images=num_images, refs_per_image=refs_per_image,
                       samples_per_image=samples, batch_images=batch_images, hypotheses=len(hyps),
                       mean_cider_d_batch_df=float(results["ours_corpus"].mean()),
                       mean_cider_d_training_df=float(results["ours_fixed"].mean()))

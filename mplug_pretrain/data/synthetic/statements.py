"""Statements about synthetic scenes (data/synthetic/scenes.py) with their true labels, for the two classification
tasks: SNLI-VE (is a hypothesis entailed by, contradicted by, or neutral to the image?) and NLVR2 (is a statement
about a pair of images true?). The scene knows every object's shape, colour and position, so each label is exact.

SNLI-VE hypotheses about one object of the scene:
  entailment     its true colour or position                "the circle is red", "the red circle is on the left"
  contradiction  another colour or position, or a shape the scene lacks   "the circle is blue", "there is a square"
  neutral        a property no image shows                  "the red circle is made of wood"
NLVR2 statements about an image pair: "the left image has a red shape", "both images have a circle",
"exactly one image has a blue shape"; drawn so that about half are true.
"""
from __future__ import annotations

import numpy as np

from mplug_pretrain.data.synthetic.scenes import COLORS, POSITION_PHRASES, SHAPES, Scene

SNLI_VE_LABELS = ("entailment", "neutral", "contradiction")
NLVR2_LABELS = ("False", "True")
UNSEEN_PROPERTIES = ("made of wood", "made of metal", "made of glass", "heavy", "brand new", "very old", "expensive")


def _other(values, current: str, rng: np.random.Generator) -> str:
    return str(rng.choice([v for v in values if v != current]))


def snli_ve_hypothesis(scene: Scene, label: str, rng: np.random.Generator) -> str:
    """One hypothesis about ``scene`` whose true label is ``label`` (one of SNLI_VE_LABELS)."""
    obj = scene.objects[int(rng.integers(len(scene.objects)))]
    if label == "neutral":
        return f"the {obj.color} {obj.shape} is {rng.choice(UNSEEN_PROPERTIES)}"
    kind = int(rng.integers(3))
    if label == "entailment":
        return [f"the {obj.shape} is {obj.color}", f"the {obj.color} {obj.shape} is {POSITION_PHRASES[obj.position]}",
                f"there is a {obj.color} {obj.shape}"][kind]
    if label != "contradiction":
        raise ValueError(f"label {label!r} not in {SNLI_VE_LABELS}")
    absent = [s for s in SHAPES if s not in {o.shape for o in scene.objects}]
    other_position = _other(POSITION_PHRASES, obj.position, rng)
    return [f"the {obj.shape} is {_other(COLORS, obj.color, rng)}",
            f"the {obj.color} {obj.shape} is {POSITION_PHRASES[other_position]}",
            f"there is a {rng.choice(absent)}" if absent else f"the {obj.shape} is {_other(COLORS, obj.color, rng)}"][kind]


def _has_color(scene: Scene, color: str) -> bool:
    return any(o.color == color for o in scene.objects)


def _has_shape(scene: Scene, shape: str) -> bool:
    return any(o.shape == shape for o in scene.objects)


def nlvr2_statement(left: Scene, right: Scene, rng: np.random.Generator) -> tuple[str, bool]:
    """(statement about the pair, whether it is true). The colour or shape asked about is drawn half the time from
    the images, half at random, so true and false statements are about equally frequent."""
    pool = [o for o in left.objects + right.objects]
    use_color = bool(rng.integers(2))
    if use_color:
        value = pool[int(rng.integers(len(pool)))].color if rng.integers(2) else str(rng.choice(list(COLORS)))
        has, noun = (lambda s: _has_color(s, value)), f"a {value} shape"
    else:
        value = pool[int(rng.integers(len(pool)))].shape if rng.integers(2) else str(rng.choice(SHAPES))
        has, noun = (lambda s: _has_shape(s, value)), f"a {value}"
    kind = int(rng.integers(4))
    if kind == 0:
        return f"the left image has {noun}", has(left)
    if kind == 1:
        return f"the right image has {noun}", has(right)
    if kind == 2:
        return f"both images have {noun}", has(left) and has(right)
    return f"exactly one image has {noun}", has(left) != has(right)

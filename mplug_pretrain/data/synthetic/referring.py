"""Referring expressions about synthetic scenes (data/synthetic/scenes.py), for visual grounding: the scene knows
every object's shape, colour, size and position, so each expression names exactly one object and its box is exact.

A scene holds 1-2 objects of different shapes at different positions, so "the circle" and "the shape on the left"
are always unique; "the red shape" is used only when no other object is red. Kinds of expression:
    "the red circle"   "the circle"   "the shape on the left"   "the large red circle on the left"   "the red shape"
Box: (cx - r, cy - r, 2r, 2r) in pixels of the rendered image (x, y, w, h; the shape's bounding square).
"""
from __future__ import annotations

import numpy as np

from mplug_pretrain.data.synthetic.scenes import POSITION_PHRASES, Scene, SceneObject


def object_box(obj: SceneObject) -> list[float]:
    """(x, y, w, h) in pixels, the object's bounding square."""
    cx, cy = obj.center
    return [cx - obj.radius, cy - obj.radius, 2 * obj.radius, 2 * obj.radius]


def referring_expressions(scene: Scene, obj: SceneObject) -> list[str]:
    """Every expression that names ``obj`` (one of ``scene.objects``) unambiguously."""
    where = POSITION_PHRASES[obj.position]
    expressions = [f"the {obj.color} {obj.shape}", f"the {obj.shape}", f"the shape {where}",
                   f"the {obj.size} {obj.color} {obj.shape} {where}"]
    if sum(o.color == obj.color for o in scene.objects) == 1:
        expressions.append(f"the {obj.color} shape")
    return expressions


def referring_expression(scene: Scene, rng: np.random.Generator) -> tuple[str, list[float]]:
    """(expression, its object's xywh box) for a random object of ``scene`` and a random kind of expression."""
    obj = scene.objects[int(rng.integers(len(scene.objects)))]
    expressions = referring_expressions(scene, obj)
    return expressions[int(rng.integers(len(expressions)))], object_box(obj)

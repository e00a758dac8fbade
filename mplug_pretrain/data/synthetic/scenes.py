"""Procedural image-text data: 1-2 coloured shapes on a textured, noisy background, with captions
that describe them and question/answer pairs about them.

A ``Scene`` is sampled from a numpy ``Generator`` (same seed -> same scene, pixels and text).
Objects never overlap (their bounding boxes are kept apart), so every caption word is visible:
"a large red circle on the left and a small blue square at the top".
Backgrounds are near-grey (low saturation), so shape colours stay unambiguous.
"""
from __future__ import annotations

import io
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 90, 230),
          "yellow": (240, 210, 40), "purple": (150, 60, 190), "orange": (245, 140, 30)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {"left": (0.2, 0.5), "right": (0.8, 0.5), "top": (0.5, 0.2), "bottom": (0.5, 0.8),
             "center": (0.5, 0.5)}  # object centre as a fraction of the image side
POSITION_PHRASES = {"left": "on the left", "right": "on the right", "top": "at the top",
                    "bottom": "at the bottom", "center": "in the center"}
SIZES = {"small": 0.1, "large": 0.17}  # half-extent as a fraction of the image side
BACKGROUNDS = ("noise", "stripes", "checker", "gradient")
JITTER = 0.04  # centre jitter, fraction of the side


@dataclass(frozen=True)
class SceneObject:
    shape: str
    color: str
    position: str
    size: str
    center: tuple[float, float]  # pixels (x, y) at the rendered size
    radius: float  # half-extent in pixels


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    background: str
    image_size: int

    def to_json(self) -> dict:
        return {"background": self.background, "image_size": self.image_size,
                "objects": [asdict(o) for o in self.objects]}


def _boxes_apart(a: SceneObject, b: SceneObject, margin: float = 1.0) -> bool:
    gap = a.radius + b.radius + margin
    return abs(a.center[0] - b.center[0]) >= gap or abs(a.center[1] - b.center[1]) >= gap


def _sample_object(rng: np.random.Generator, image_size: int, shape: str) -> SceneObject:
    position = str(rng.choice(list(POSITIONS)))
    size = str(rng.choice(list(SIZES)))
    fx, fy = POSITIONS[position]
    jx, jy = rng.uniform(-JITTER, JITTER, size=2)
    return SceneObject(shape=shape, color=str(rng.choice(list(COLORS))), position=position, size=size,
                       center=(float((fx + jx) * image_size), float((fy + jy) * image_size)),
                       radius=float(SIZES[size] * image_size))


def sample_scene(rng: np.random.Generator, image_size: int = 64) -> Scene:
    """1 or 2 objects with different shapes and positions (so questions have one answer)."""
    num_objects = int(rng.integers(1, 3))
    shapes = [str(s) for s in rng.choice(SHAPES, size=num_objects, replace=False)]
    objects = [_sample_object(rng, image_size, shapes[0])]
    while len(objects) < num_objects:
        candidate = _sample_object(rng, image_size, shapes[1])
        if candidate.position != objects[0].position and _boxes_apart(candidate, objects[0]):
            objects.append(candidate)
    return Scene(objects=tuple(objects), background=str(rng.choice(BACKGROUNDS)), image_size=image_size)


def render_background(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """float [size, size, 3] in 0..255: a grey texture with a slight tint and pixel noise."""
    lo, hi = sorted(rng.uniform(70, 210, size=2))
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    if kind == "noise":
        level = np.full((size, size), (lo + hi) / 2, np.float32)
    elif kind == "stripes":
        period = rng.integers(4, 11)
        direction = [xx, yy, xx + yy][int(rng.integers(3))]
        level = np.where((direction // period) % 2 == 0, lo, hi).astype(np.float32)
    elif kind == "checker":
        cell = rng.integers(4, 11)
        level = np.where(((xx // cell) + (yy // cell)) % 2 == 0, lo, hi).astype(np.float32)
    elif kind == "gradient":
        level = lo + (hi - lo) * (xx if rng.integers(2) else yy) / max(size - 1, 1)
    else:
        raise ValueError(f"background {kind!r} not in {BACKGROUNDS}")
    tint = rng.uniform(-12, 12, size=3).astype(np.float32)
    noise = rng.normal(0, 12 if kind == "noise" else 6, size=(size, size, 3)).astype(np.float32)
    return level[..., None] + tint + noise


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, center: tuple[float, float], radius: float,
               color: tuple[int, int, int]) -> None:
    cx, cy = center
    if shape == "circle":
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=color)
    elif shape == "square":
        draw.rectangle([cx - radius, cy - radius, cx + radius, cy + radius], fill=color)
    elif shape == "triangle":
        draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=color)
    else:
        raise ValueError(f"shape {shape!r} not in {SHAPES}")


def render_scene(scene: Scene, rng: np.random.Generator) -> Image.Image:
    pixels = render_background(scene.background, scene.image_size, rng)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        draw_shape(draw, obj.shape, obj.center, obj.radius, COLORS[obj.color])
    return image


def encode_jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _object_phrase(obj: SceneObject) -> str:
    return f"a {obj.size} {obj.color} {obj.shape} {POSITION_PHRASES[obj.position]}"


def caption_variants(scene: Scene) -> list[str]:
    """Distinct phrasings of the same scene (at least four)."""
    phrases = [_object_phrase(o) for o in scene.objects]
    listed = " and ".join(phrases)
    count = "one shape" if len(phrases) == 1 else "two shapes"
    variants = [listed, " and ".join(reversed(phrases)), f"there is {listed}", f"a picture of {listed}",
                f"{count}: {listed}"]
    return list(dict.fromkeys(variants))


def scene_captions(scene: Scene, k: int, rng: np.random.Generator) -> list[str]:
    variants = caption_variants(scene)
    if not 1 <= k <= len(variants):
        raise ValueError(f"captions per scene: {k} not in 1..{len(variants)}")
    order = rng.permutation(len(variants))[:k]
    return [variants[i] for i in order]


def scene_questions(scene: Scene, rng: np.random.Generator) -> list[dict]:
    """Single-word answers: colour, size, position and shape of each object, count, existence."""
    qa = [{"question": "how many shapes are there?", "answer": str(len(scene.objects))}]
    present = {(o.color, o.shape) for o in scene.objects}
    for obj in scene.objects:
        qa += [{"question": f"what color is the {obj.shape}?", "answer": obj.color},
               {"question": f"is the {obj.shape} large or small?", "answer": obj.size},
               {"question": f"where is the {obj.shape}?", "answer": obj.position},
               {"question": f"what shape is {POSITION_PHRASES[obj.position]}?", "answer": obj.shape},
               {"question": f"is there a {obj.color} {obj.shape}?", "answer": "yes"}]
    absent = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in present]
    color, shape = absent[int(rng.integers(len(absent)))]
    qa.append({"question": f"is there a {color} {shape}?", "answer": "no"})
    return qa

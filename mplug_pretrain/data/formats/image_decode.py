"""Bytes -> checked sample fields. PIL only (torchvision.io does not load on CPU torch here).

``to_rgb`` maps every PIL mode to 8-bit RGB:
  greyscale ``L``/``1``, ``CMYK``, ``YCbCr``, ``LAB``, ``HSV`` -> PIL's own conversion;
  16/32-bit integer greyscale (``I;16*``, ``I``) -> value / 257 rounded (65535 -> 255; PIL's
  ``convert`` would clip everything above 255 to white);
  alpha (``RGBA``, ``LA``, ``PA``, palette with transparency) -> composited over white, i.e.
  ``out = a * c + (1 - a) * 255`` with ``a = alpha / 255``.
A broken field raises ``SampleError`` whose ``kind`` is the ``DecodeStats`` counter it goes to.

Decompression bombs: an image of more than ``max_image_pixels`` (width x height from the header, read before
any pixel is decoded; data.max_image_pixels, default 64 Mpx) is skipped as ``too_many_pixels``. PIL's own limit
(``Image.MAX_IMAGE_PIXELS``) is set to the same value in every process that imports this module or sets the cap,
so no other PIL call of ours decodes a bomb either.

Draft mode (training only): ``draft_side`` lets libjpeg decode a JPEG at 1/2, 1/4 or 1/8 scale (its DCT scaling)
when the image stays at least ``draft_side`` pixels on each side: a 2048 x 1536 photo for 256 px training with
draft_side 512 decodes at 1024 x 768. Those pixels are libjpeg's scaled IDCT, close to a box-filtered
downscale, not PIL's; evaluation never drafts.
"""
from __future__ import annotations

import io
import json
import warnings

import numpy as np
from PIL import Image

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tiff", "tif")
_INT_GREY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "LA", "La", "RGBa", "PA")
DEFAULT_MAX_IMAGE_PIXELS = 64 * 2**20
_limits = {"max_image_pixels": DEFAULT_MAX_IMAGE_PIXELS}


def set_max_image_pixels(max_pixels: int) -> None:
    """The pixel cap of this process: ours and PIL's (a DataLoader worker calls it with the spec's value)."""
    _limits["max_image_pixels"] = int(max_pixels)
    Image.MAX_IMAGE_PIXELS = int(max_pixels)


set_max_image_pixels(DEFAULT_MAX_IMAGE_PIXELS)


class SampleError(Exception):
    """One sample cannot be used; ``kind`` names the counter (e.g. ``corrupt_image``)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def to_rgb(image: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _INT_GREY_MODES:
        values = np.asarray(image).astype(np.float64)
        grey = np.floor(np.clip(values, 0, 65535) / 257.0 + 0.5).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        mode = image.mode
        if mode == "RGB":
            return image
    if mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        base = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(base, rgba).convert("RGB")
    return image.convert("RGB")


def open_image(data: bytes) -> Image.Image:
    """The header only (nothing decoded yet); more than the pixel cap raises ``too_many_pixels``."""
    max_pixels = _limits["max_image_pixels"]
    try:
        with warnings.catch_warnings():  # PIL warns above its limit and raises above twice it: both are a skip
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise SampleError("too_many_pixels", f"image over the {max_pixels}-pixel cap (data.max_image_pixels): "
                                             f"{err}") from err
    width, height = image.size
    if width * height > max_pixels:
        raise SampleError("too_many_pixels", f"{width} x {height} image over the {max_pixels}-pixel cap "
                                             "(data.max_image_pixels)")
    return image


def decode_image(data: bytes | None, draft_side: int | None = None) -> Image.Image:
    """Encoded image bytes -> RGB PIL image, fully loaded (a truncated file fails here, not later).
    ``draft_side``: a JPEG may decode at a reduced scale that keeps both sides >= it (training only)."""
    if data is None:
        raise SampleError("missing_image", "no image field (jpg/png/...)")
    if len(data) == 0:
        raise SampleError("empty_image", "zero-byte image")
    try:
        image = open_image(data)
        full_size = image.size
        if draft_side is not None and image.format == "JPEG" and image.draft(image.mode, (draft_side, draft_side)):
            image.info["undrafted_size"] = full_size  # the crop box is drawn on it (data/resized_crop.py)
        image.load()
    except SampleError:
        raise
    except Exception as err:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ValueError...
        raise SampleError("corrupt_image", f"undecodable image ({type(err).__name__}: {err})") from err
    return to_rgb(image)


def image_field(sample: dict) -> bytes | None:
    for ext in IMAGE_EXTENSIONS:
        if ext in sample:
            return sample[ext]
    return None


def decode_text(data: bytes | None, kind: str = "caption") -> str:
    """UTF-8 text, whitespace-normalized; missing, empty or non-UTF-8 raises."""
    if data is None:
        raise SampleError(f"missing_{kind}", f"no {kind}")
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else str(data)
    except UnicodeDecodeError as err:
        raise SampleError(f"bad_{kind}_encoding", f"{kind} is not UTF-8 ({err})") from err
    text = " ".join(text.split())
    if not text:
        raise SampleError(f"missing_{kind}", f"empty {kind}")
    return text


def decode_json(data: bytes | None) -> dict:
    if data is None:
        return {}
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SampleError("bad_json", f"invalid json ({err})") from err
    if not isinstance(value, dict):
        raise SampleError("bad_json", f"json is a {type(value).__name__}, expected an object")
    return value

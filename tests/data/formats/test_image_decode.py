"""Image mode conversion to 8-bit RGB, checked against hand-computed values, and the same images
decoded through the reader pipeline."""
import io

import numpy as np
import pytest
from PIL import Image

from mplug_pretrain.data.formats.image_decode import SampleError, decode_image, to_rgb
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from mplug_pretrain.data.writers.shard_writer import ShardWriter


def encode(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def over_white(value, alpha):
    return value * alpha / 255 + 255 * (1 - alpha / 255)


def test_greyscale_and_bilevel():
    grey = to_rgb(Image.fromarray(np.array([[0, 77, 255]], np.uint8), "L"))
    assert grey.mode == "RGB" and np.asarray(grey).tolist() == [[[0] * 3, [77] * 3, [255] * 3]]
    bilevel = to_rgb(Image.fromarray(np.array([[0, 255]], np.uint8), "L").convert("1"))
    assert np.asarray(bilevel).tolist() == [[[0] * 3, [255] * 3]]


def test_alpha_is_composited_over_white():
    rgba = np.array([[[200, 10, 60, 255], [200, 10, 60, 0], [200, 10, 60, 128]]], np.uint8)
    out = np.asarray(to_rgb(Image.fromarray(rgba, "RGBA"))).astype(float)
    expected = [[over_white(c, a) for c in px[:3]] for px in rgba[0].astype(float) for a in [px[3]]]
    assert np.abs(out[0] - np.array(expected)).max() <= 1
    la = np.asarray(to_rgb(Image.fromarray(np.array([[[90, 64]]], np.uint8), "LA"))).astype(float)
    assert np.abs(la[0, 0] - over_white(90, 64)).max() <= 1


def test_palette_with_transparency():
    image = Image.new("P", (2, 1))
    image.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    image.putpixel((0, 0), 0)
    image.putpixel((1, 0), 1)
    image.info["transparency"] = 1
    reopened = Image.open(io.BytesIO(encode(image, "PNG")))
    assert reopened.mode == "P"
    assert np.asarray(to_rgb(reopened)).tolist() == [[[255, 0, 0], [255, 255, 255]]]


def test_cmyk_without_black_is_the_complement():
    out = to_rgb(Image.new("CMYK", (2, 2), (100, 50, 0, 0)))
    assert out.getpixel((0, 0)) == (155, 205, 255)
    jpeg = decode_image(encode(Image.new("CMYK", (16, 16), (100, 50, 0, 0)), "JPEG"))
    assert np.abs(np.asarray(jpeg).astype(int) - [155, 205, 255]).max() <= 6


def test_sixteen_bit_greyscale_scales_instead_of_clipping():
    values = np.array([[0, 257, 32896, 65535, 1000]], np.uint16)
    decoded = decode_image(encode(Image.fromarray(values), "PNG"))
    expected = np.floor(values / 257 + 0.5).astype(int)
    assert decoded.mode == "RGB"
    assert np.asarray(decoded)[..., 0].tolist() == expected.tolist()
    assert np.asarray(decoded)[..., 1].tolist() == expected.tolist()


@pytest.mark.parametrize("data,kind", [(None, "missing_image"), (b"", "empty_image"),
                                       (b"GIF89a not really", "corrupt_image")])
def test_broken_bytes_name_their_kind(data, kind):
    with pytest.raises(SampleError) as err:
        decode_image(data)
    assert err.value.kind == kind


def test_truncated_jpeg_is_corrupt():
    data = encode(Image.effect_noise((64, 64), 50).convert("RGB"), "JPEG")
    with pytest.raises(SampleError) as err:
        decode_image(data[: len(data) // 2])
    assert err.value.kind == "corrupt_image"


def test_all_modes_decode_through_the_pipeline(tmp_path, tokenizer):
    images = {
        "grey": ("png", Image.new("L", (20, 12), 90)),
        "rgba": ("png", Image.new("RGBA", (12, 20), (10, 200, 30, 100))),
        "cmyk": ("jpg", Image.new("CMYK", (20, 20), (0, 120, 200, 0))),
        "grey16": ("png", Image.fromarray(np.full((16, 16), 40000, np.uint16))),
        "palette": ("png", Image.new("RGB", (16, 16), (5, 99, 7)).convert("P")),
        "rgb": ("jpg", Image.new("RGB", (30, 10), (1, 2, 3))),
    }
    with ShardWriter(str(tmp_path), "modes", kind="image-text", created_by="test") as writer:
        for key, (ext, image) in images.items():
            writer.write({"__key__": key, ext: encode(image, "PNG" if ext == "png" else "JPEG"),
                          "txt": f"a {key} image"})
    spec = LoaderSpec(str(tmp_path / "modes-000000.tar"), batch_size=len(images), shuffle=False)
    lo = build_pretrain_loader(spec, tokenizer, image_size=16, max_text_len=8, augment=False)
    (batch,) = list(lo)
    assert sorted(batch["__key__"]) == sorted(images) and not batch["is_pad"].any()
    assert batch["image"].shape == (len(images), 3, 16, 16) and bool(batch["image"].isfinite().all())
    assert lo.stats.skipped == {} and lo.stats.counts["decoded"] == len(images)


def test_draft_mode_decodes_large_jpegs_smaller_and_nothing_else():
    """``draft_side``: a JPEG at least 2x it on each side decodes at 1/2 (1/4, 1/8) scale, keeping both sides
    >= it and its full size in info; smaller JPEGs, PNGs and ``draft_side=None`` decode at full size."""
    from tests.data.photo_samples import photo, photo_jpeg
    big = photo_jpeg(0, (400, 300))
    drafted = decode_image(big, draft_side=96)
    assert drafted.size == (200, 150) and drafted.info["undrafted_size"] == (400, 300)
    assert decode_image(big, draft_side=40).size == (100, 75)  # 1/4: still >= 40 a side
    assert decode_image(big, draft_side=151).size == (400, 300)  # 1/2 would leave 150 < 151
    assert decode_image(big).size == (400, 300) and "undrafted_size" not in decode_image(big).info
    png = io.BytesIO()
    photo(0, (400, 300)).save(png, format="PNG")
    assert decode_image(png.getvalue(), draft_side=40).size == (400, 300)
    # the half-scale decode is the same picture: close to a box-filtered full decode
    full = np.asarray(decode_image(big).resize((200, 150), Image.BOX)).astype(int)
    assert np.abs(np.asarray(drafted).astype(int) - full).mean() < 3

"""`mplug caption` with unreadable files among good ones (issue 36, item 5): the readable images are captioned,
each unreadable one is listed on stderr with the reason, exit 0; exit 3 with one line when none was readable. A
truncated, an empty, a non-image and a decompression-bomb file (a PNG whose header claims 200 megapixels) each
used to abort the whole call with a traceback."""
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from tests.helpers import call_mplug

pytestmark = pytest.mark.usefixtures("one_thread")


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG signature and header for a width x height RGB image, no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


@pytest.fixture
def photos(tmp_path):
    good = []
    for i in range(2):
        path = tmp_path / f"good{i}.png"
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(path)
        good.append(path)
    whole = (tmp_path / "good0.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "notes.jpg").write_text("not an image at all")
    (tmp_path / "bomb.png").write_bytes(_png_claiming(20000, 10000))
    return good


def test_readable_images_are_captioned_and_the_others_listed(model_dir, photos, tmp_path):
    out = tmp_path / "results.json"
    proc = call_mplug(["caption", "--checkpoint", model_dir, tmp_path, "--beam-size", "2", "--max-length", "5",
                       "--out", out])
    assert proc.returncode == 0, proc.stderr
    captioned = [line.split("\t")[0] for line in proc.stdout.splitlines()]
    assert captioned == [str(p) for p in photos]
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("mplug: skipped ")]
    assert [line.removeprefix("mplug: skipped ").split(": ")[0] for line in skipped] == [str(tmp_path / n) for n in
                                                         ("bomb.png", "empty.jpg", "notes.jpg", "truncated.png")]
    assert "DecompressionBombError" in skipped[0] and all("not a readable image" in line for line in skipped)
    assert proc.stderr.splitlines()[-1] == "mplug: captioned 2 of 6 images; 4 unreadable (listed above)"
    assert "Traceback" not in proc.stderr
    assert {r["image_id"] for r in json.loads(out.read_text())} == {"good0", "good1"}


def test_no_readable_image_is_exit_3(model_dir, photos, tmp_path):
    proc = call_mplug(["caption", "--checkpoint", model_dir, tmp_path / "empty.jpg", tmp_path / "bomb.png"])
    assert proc.returncode == 3 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == "mplug: data error: none of the 2 image(s) could be read"

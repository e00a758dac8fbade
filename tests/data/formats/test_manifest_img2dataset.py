"""img2dataset's output folder as pretraining shards (issue 26): ``NNNNN.tar`` holding ``KEY.jpg/.txt/.json``
(KEY = shard number and index, 9 digits), ``NNNNN_stats.json`` beside each tar and ``NNNNN.parquet`` (the
per-URL status table; this package never reads it, so the test writes a placeholder with parquet's magic bytes
rather than install pyarrow). The folder itself, or a glob, is accepted as data.train_shards, sample counts
come from ``_stats.json``, and a folder or glob that names no shard fails at config validation."""
from __future__ import annotations

import io
import json
import os
import tarfile

import pytest
from PIL import Image

from mplug_pretrain.config import load_config
from mplug_pretrain.data.formats.manifest import shard_sample_counts
from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import build_pretrain_loader
from mplug_pretrain.data.reading.urls import all_shards, expand_sources
from mplug_pretrain.errors import ConfigError


def _jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), ((seed * 40) % 256, 90, 200)).save(buf, format="JPEG")
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_img2dataset_folder(out: str, sizes: list[int], failed: int = 1) -> dict[str, str]:
    """What `img2dataset --output_format webdataset` leaves: per shard a tar of successes, its stats (the URLs
    tried, successes and failures) and its parquet. -> {key: caption} of every sample written."""
    os.makedirs(out, exist_ok=True)
    captions = {}
    for shard, size in enumerate(sizes):
        with tarfile.open(os.path.join(out, f"{shard:05d}.tar"), "w") as tar:
            for i in range(size):
                key = f"{shard:05d}{i:04d}"
                caption = f"a photo number {i} of shard {shard}"
                meta = {"url": f"https://example.org/{key}.jpg", "caption": caption, "key": key,
                        "status": "success", "error_message": None, "width": 40, "height": 30,
                        "original_width": 400, "original_height": 300, "exif": "{}", "sha256": "0" * 64}
                _add(tar, f"{key}.jpg", _jpeg(shard * 100 + i))
                _add(tar, f"{key}.txt", caption.encode())
                _add(tar, f"{key}.json", json.dumps(meta).encode())
                captions[key] = caption
        stats = {"count": size + failed, "successes": size, "failed_to_download": failed, "failed_to_resize": 0,
                 "duration": 1.5, "start_time": 0.0, "end_time": 1.5, "status_dict": {"success": size},
                 "config": {"output_format": "webdataset", "image_size": 40}}
        with open(os.path.join(out, f"{shard:05d}_stats.json"), "w") as f:
            json.dump(stats, f)
        with open(os.path.join(out, f"{shard:05d}.parquet"), "wb") as f:
            f.write(b"PAR1" + b"\0" * 8 + b"PAR1")
    return captions


def test_the_folder_is_read_as_its_shards_with_counts_from_the_stats(tmp_path, tokenizer):
    out = str(tmp_path / "laion_subset")
    captions = write_img2dataset_folder(out, [5, 3])
    tars = [os.path.join(out, "00000.tar"), os.path.join(out, "00001.tar")]
    for spec in (out, os.path.join(out, "*.tar"), os.path.join(out, "{00000..00001}.tar")):
        assert all_shards(expand_sources(spec)) == tars
        cfg = load_config(None, [f"data.train_shards={spec}", "model.preset=tiny"])  # validation accepts it
        assert cfg.data.train_shards == spec
    assert shard_sample_counts(tars) == [5, 3]
    loader = build_pretrain_loader(LoaderSpec(out, batch_size=4, shuffle=False, rank=0, world_size=1),
                                   tokenizer, image_size=32, max_text_len=24, augment=False)
    seen = {}
    for batch in loader:
        for key, text, pad in zip(batch["__key__"], batch["text"], batch["is_pad"].tolist()):
            if not pad:
                seen[key] = text
    assert seen == captions


def test_the_stats_are_what_the_epoch_is_planned_from(tmp_path):
    """Counts come from the stats file (like a manifest: the tars are not opened to plan an epoch)."""
    out = str(tmp_path / "i2d")
    write_img2dataset_folder(out, [5])
    stats_path = os.path.join(out, "00000_stats.json")
    with open(stats_path) as f:
        stats = json.load(f)
    stats["successes"] = 4
    with open(stats_path, "w") as f:
        json.dump(stats, f)
    assert shard_sample_counts([os.path.join(out, "00000.tar")]) == [4]
    os.remove(stats_path)  # no stats: the tar is listed
    assert shard_sample_counts([os.path.join(out, "00000.tar")]) == [5]


@pytest.mark.parametrize("spec, message", [
    ("{root}/empty", "data.train_shards: folder {root}/empty holds no .tar shards"),
    ("{root}/i2d/*.tgz", "data.train_shards: no file matches {root}/i2d/*.tgz"),
])
def test_a_folder_or_glob_without_shards_fails_at_validation(tmp_path, spec, message):
    """It used to pass validation, build the model, then fail with "no samples in 1 shard(s)"."""
    write_img2dataset_folder(str(tmp_path / "i2d"), [2])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "00000.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.train_shards={spec.format(root=tmp_path)}"])
    assert str(err.value) == message.format(root=tmp_path)

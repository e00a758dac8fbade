"""``manifest.json`` beside a folder of shards: which shard files each data set has and how many
samples each holds. The reader plans exact epochs from these counts without opening the tars.

One folder may hold several data sets (``train-*.tar`` and ``val-*.tar``), keyed by name::

    {"format": "mplug_pretrain.shards/1",
     "datasets": {"train": {"kind": "image-text", "created_by": "mplug_pretrain 0.1.0 make-shards coco ...",
                            "shards": [{"file": "train-000000.tar", "samples": 1000, "bytes": 2150400}, ...],
                            "total": 4000, ...extra: layout, answer_list, skipped_missing}}}
"""
from __future__ import annotations

import json
import os
import re
import tarfile
from functools import lru_cache

from mplug_pretrain.errors import DataError
from mplug_pretrain.utils.atomic_files import write_json_atomic

MANIFEST_NAME = "manifest.json"
FORMAT = "mplug_pretrain.shards/1"
KINDS = ("image-text", "vqa", "video", "classification", "grounding")
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext rule


def manifest_path(folder: str) -> str:
    return os.path.join(folder, MANIFEST_NAME)


def read_manifest(folder: str) -> dict:
    """The folder's manifest (``{"format", "datasets"}``), or an empty one when there is none."""
    path = manifest_path(folder)
    if not os.path.exists(path):
        return {"format": FORMAT, "datasets": {}}
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: unreadable manifest ({err})") from err
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("datasets"), dict):
        raise DataError(f"{path}: not a {FORMAT} manifest (keys: {sorted(manifest)})")
    for name, entry in manifest["datasets"].items():
        counts = [s.get("samples") for s in entry.get("shards", [])]
        if any(not isinstance(c, int) or c < 0 for c in counts) or sum(counts) != entry.get("total"):
            raise DataError(f"{path}: data set {name!r}: shard sample counts {counts} do not add up to "
                            f"total {entry.get('total')}")
    return manifest


def write_manifest_entry(folder: str, name: str, entry: dict) -> dict:
    """Set data set ``name`` in the folder's manifest (others are kept); written atomically."""
    if entry.get("kind") not in KINDS:
        raise DataError(f"{manifest_path(folder)}: data set {name!r}: kind {entry.get('kind')!r} not in {KINDS}")
    manifest = read_manifest(folder)
    manifest["datasets"][name] = entry
    write_json_atomic(manifest_path(folder), manifest, indent=1, sort_keys=True)
    _manifest_counts.cache_clear()
    return manifest


def local_path(url: str) -> str | None:
    """The file system path of a shard URL, or None for remote ones (``http://``, ``pipe:``...)."""
    if url.startswith("file://"):
        return url[len("file://"):]
    if url.startswith("file:"):
        return url[len("file:"):]
    if "://" in url or url.startswith("pipe:"):
        return None
    return url


@lru_cache(maxsize=256)
def _manifest_counts(folder: str, mtime: float) -> dict[str, int]:
    counts = {}
    for entry in read_manifest(folder)["datasets"].values():
        for shard in entry["shards"]:
            counts[shard["file"]] = shard["samples"]
    return counts


def dataset_entry(shard_url: str) -> dict | None:
    """The manifest entry of the data set a local shard belongs to (None when not listed)."""
    path = local_path(shard_url)
    if path is None:
        return None
    base = os.path.basename(path)
    for entry in read_manifest(os.path.dirname(os.path.abspath(path)))["datasets"].values():
        if any(s["file"] == base for s in entry["shards"]):
            return entry
    return None


def listed_kinds(shard_urls: list[str]) -> dict[str, str]:
    """{url: kind} of the local shards whose folder's manifest lists them (each manifest read once)."""
    kinds: dict[str, str] = {}
    by_folder: dict[str, dict[str, str]] = {}
    for url in shard_urls:
        path = local_path(url)
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in by_folder:
            by_folder[folder] = {s["file"]: entry.get("kind") for entry in read_manifest(folder)["datasets"].values()
                                 for s in entry["shards"]}
        kind = by_folder[folder].get(os.path.basename(path))
        if kind is not None:
            kinds[url] = kind
    return kinds


def shard_sample_counts(shard_urls: list[str]) -> list[int]:
    """Samples per shard: from ``manifest.json`` beside each shard, else by listing the tar."""
    counts = []
    for url in shard_urls:
        path = local_path(url)
        if path is None:
            raise DataError(f"{url}: exact epochs need sample counts; remote shards must be counted "
                            "from a local copy of their manifest (use mode='resampled' with samples_per_epoch)")
        if not os.path.exists(path):
            raise DataError(f"{url}: shard file does not exist")
        folder = os.path.dirname(os.path.abspath(path))
        mpath = manifest_path(folder)
        listed = _manifest_counts(folder, os.path.getmtime(mpath)) if os.path.exists(mpath) else {}
        base = os.path.basename(path)
        if base in listed:
            counts.append(listed[base])
        else:
            stats = img2dataset_count(path)
            counts.append(stats if stats is not None else count_tar_samples(path))
    return counts


def count_source(shard_url: str) -> str:
    """The file ``shard_sample_counts`` took a local shard's count from: the folder's manifest.json when it lists
    the shard, else img2dataset's ``NNNNN_stats.json``, else the tar itself."""
    path = local_path(shard_url) or shard_url
    folder = os.path.dirname(os.path.abspath(path))
    mpath = manifest_path(folder)
    if os.path.exists(mpath) and os.path.basename(path) in _manifest_counts(folder, os.path.getmtime(mpath)):
        return mpath
    stats = os.path.splitext(path)[0] + "_stats.json"
    return stats if os.path.isfile(stats) else path


def img2dataset_count(path: str) -> int | None:
    """The samples img2dataset wrote into ``NNNNN.tar``: ``successes`` of ``NNNNN_stats.json`` beside it (the
    images it could not fetch or resize are counted there as failures and not in the tar); None without one."""
    stats = os.path.splitext(path)[0] + "_stats.json"
    if not os.path.isfile(stats):
        return None
    try:
        with open(stats) as f:
            successes = json.load(f).get("successes")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise DataError(f"{stats}: unreadable img2dataset stats ({err})") from err
    if not isinstance(successes, int) or successes < 0:
        raise DataError(f"{stats}: expected an integer 'successes', got {successes!r}")
    return successes


def count_tar_samples(path: str) -> int:
    """Number of samples (runs of members sharing a key) in a tar; stops quietly at truncation."""
    count, previous = 0, None
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                match = _KEY_EXT.match(member.name)
                if not member.isreg() or not match:
                    continue
                if match.group(1) != previous:
                    count, previous = count + 1, match.group(1)
    except (tarfile.TarError, EOFError, OSError):
        pass  # the reader skips and counts what a broken tar lacks
    return count

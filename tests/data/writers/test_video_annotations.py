"""`mplug make-shards video` reads the captions of every common annotation layout (issue 36, item 3): VATEX keeps
its English captions under ``enCap`` and the video under ``videoID``; they used to be dropped silently."""
import json
import tarfile

from tests.helpers import call_mplug


def _videos(tmp_path, names):
    folder = tmp_path / "videos"
    folder.mkdir()
    for name in names:
        (folder / f"{name}.mp4").write_bytes(f"raw bytes of {name}, copied not decoded".encode())
    return folder


def _captions_written(out):
    captions = {}
    for tar_path in sorted(out.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(member).read())
                    captions[meta["video_id"]] = meta["captions"]
    return captions


def test_vatex_english_captions_are_read(tmp_path):
    videos = _videos(tmp_path, ["abc_000010_000020", "xyz_000001_000011"])
    vatex = [{"videoID": "abc_000010_000020", "enCap": ["A man plays a guitar.", "Someone strums."],
              "chCap": ["一个男人在弹吉他。"]},
             {"videoID": "xyz_000001_000011", "enCap": ["A dog runs on a beach."], "chCap": ["一只狗。"]}]
    (tmp_path / "vatex_val.json").write_text(json.dumps(vatex))
    proc = call_mplug(["make-shards", "video", "--videos", videos, "--annotations", tmp_path / "vatex_val.json",
                       "--video-key", "videoID", "--out", tmp_path / "out"])
    assert proc.returncode == 0, proc.stderr
    assert _captions_written(tmp_path / "out") == {r["videoID"]: r["enCap"] for r in vatex}


def test_caption_key_names_another_layout(tmp_path):
    videos = _videos(tmp_path, ["v1"])
    (tmp_path / "ann.json").write_text(json.dumps([{"clip": "v1", "desc": ["a red ball rolls"]}]))
    proc = call_mplug(["make-shards", "video", "--videos", videos, "--annotations", tmp_path / "ann.json",
                       "--video-key", "clip", "--caption-key", "desc", "--out", tmp_path / "out"])
    assert proc.returncode == 0, proc.stderr
    assert _captions_written(tmp_path / "out") == {"v1": ["a red ball rolls"]}


def test_annotations_without_a_caption_field_known_are_refused(tmp_path):
    videos = _videos(tmp_path, ["v1"])
    (tmp_path / "ann.json").write_text(json.dumps([{"clip": "v1", "desc": ["a red ball rolls"]}]))
    proc = call_mplug(["make-shards", "video", "--videos", videos, "--annotations", tmp_path / "ann.json",
                       "--video-key", "clip", "--out", tmp_path / "out"])
    assert proc.returncode == 3
    assert proc.stderr.startswith("mplug: data error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "--caption-key" in proc.stderr and "'desc'" in proc.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.tar"))

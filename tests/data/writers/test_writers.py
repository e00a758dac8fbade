"""Every writer: shards list with `tar tf`, and read back (tarfile, independent of our reader)
with the source content; rolling by samples and bytes; manifest counts; the make-shards CLI."""
import argparse
import io
import json
import os
import subprocess
import tarfile

import numpy as np
import pytest
from PIL import Image

from mplug_pretrain.cli.commands import make_shards
from mplug_pretrain.data.formats.manifest import read_manifest
from mplug_pretrain.data.synthetic.scenes import COLORS, POSITION_PHRASES
from mplug_pretrain.data.synthetic.videos import encode_mp4
from mplug_pretrain.data.writers.coco import write_coco_shards
from mplug_pretrain.data.writers.easy_vqa import write_easy_vqa_shards
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards, write_synthetic_video_shards
from mplug_pretrain.data.writers.table import write_table_shards
from mplug_pretrain.data.writers.video import write_video_shards
from mplug_pretrain.data.writers.vqa import write_vqa_shards
from mplug_pretrain.errors import DataError


def tar_names(path):
    return subprocess.run(["tar", "tf", path], check=True, capture_output=True, text=True).stdout.split()


def read_tars(folder, name):
    """{member name: bytes} over every shard of a data set, and the manifest entry."""
    entry = read_manifest(folder)["datasets"][name]
    members = {}
    for shard in entry["shards"]:
        path = os.path.join(folder, shard["file"])
        names = tar_names(path)
        with tarfile.open(path) as tar:
            assert [m.name for m in tar.getmembers()] == names
            content = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        assert len({n.split(".")[0] for n in names}) == shard["samples"]
        members.update(content)
    assert entry["total"] == sum(s["samples"] for s in entry["shards"])
    return members, entry


@pytest.fixture(scope="module")
def image_folder(module_mktemp):
    root = module_mktemp("images")
    (root / "val2014").mkdir()
    files = {}
    for image_id, color in [(42, (200, 0, 0)), (7, (0, 200, 0)), (1234, (0, 0, 200))]:
        path = root / "val2014" / f"COCO_val2014_{image_id:012d}.jpg"
        Image.new("RGB", (40, 30), color).save(path, quality=92)
        files[image_id] = path
    return root, files


def test_coco_annotations_round_trip(tmp_path, image_folder):
    root, files = image_folder
    anns = {"images": [{"id": i, "file_name": p.name} for i, p in files.items()],
            "annotations": [{"id": 10 + n, "image_id": i, "caption": f"caption {n} of image {i}"}
                            for n, i in enumerate([42, 7, 42, 1234, 42])]}
    ann_path = tmp_path / "captions.json"
    ann_path.write_text(json.dumps(anns))
    write_coco_shards(str(ann_path), str(root / "val2014"), str(tmp_path / "out"), max_samples=2)
    members, entry = read_tars(str(tmp_path / "out"), "coco")
    assert entry["total"] == 5 and [s["samples"] for s in entry["shards"]] == [2, 2, 1]
    for a in anns["annotations"]:
        keys = [n[:-4] for n in members if n.endswith(".txt") and members[n].decode() == a["caption"]]
        assert len(keys) == 1
        meta = json.loads(members[keys[0] + ".json"])
        assert meta["image_id"] == a["image_id"] and meta["caption_id"] == a["id"]
        assert members[keys[0] + ".jpg"] == files[a["image_id"]].read_bytes()


def test_karpathy_split_selection_and_image_layout(tmp_path, image_folder):
    root, files = image_folder
    karpathy = {"images": [
        {"cocoid": 42, "filepath": "val2014", "filename": files[42].name, "split": "test",
         "sentences": [{"raw": "A red picture.", "sentid": 1}, {"raw": "Red!", "sentid": 2}]},
        {"cocoid": 7, "filepath": "val2014", "filename": files[7].name, "split": "train",
         "sentences": [{"raw": "green", "sentid": 3}]},
        {"cocoid": 1234, "filepath": "val2014", "filename": files[1234].name, "split": "restval",
         "sentences": [{"raw": "blue", "sentid": 4}]}]}
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(karpathy))
    write_coco_shards(str(path), str(root), str(tmp_path / "test"), split="test", layout="image")
    members, entry = read_tars(str(tmp_path / "test"), "coco")
    assert entry["total"] == 1 and entry["layout"] == "image"
    assert json.loads(members["000000000042.json"])["captions"] == ["A red picture.", "Red!"]
    assert members["000000000042.jpg"] == files[42].read_bytes()
    write_coco_shards(str(path), str(root), str(tmp_path / "train"), split="train,restval")
    members, _ = read_tars(str(tmp_path / "train"), "coco")
    assert sorted(n for n in members if n.endswith(".txt")) == ["000000000007_0.txt", "000000001234_0.txt"]
    with pytest.raises(DataError, match="no image in split"):
        write_coco_shards(str(path), str(root), str(tmp_path / "none"), split="val")


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_table_round_trip(tmp_path, image_folder, suffix):
    root, files = image_folder
    rows = [(f"val2014/{files[42].name}", "first, with comma"), (f"val2014/{files[7].name}", "second"),
            (f"val2014/{files[42].name}", "third")]
    table = tmp_path / f"table{suffix}"
    if suffix == ".jsonl":
        table.write_text("".join(json.dumps({"path": p, "text": c}) + "\n" for p, c in rows))
    else:
        sep = "\t" if suffix == ".tsv" else ","
        table.write_text(f"path{sep}text\n" + "".join(f'{p}{sep}"{c}"\n' for p, c in rows))
    write_table_shards(str(table), str(tmp_path / "out"), image_column="path", caption_column="text",
                       image_root=str(root))
    members, _ = read_tars(str(tmp_path / "out"), "table")
    got = {members[n].decode(): json.loads(members[n[:-4] + ".json"])["image_id"]
           for n in members if n.endswith(".txt")}
    assert set(got) == {c for _, c in rows}
    assert got["first, with comma"] == got["third"] != got["second"]
    with pytest.raises(DataError, match="no column 'caption'"):
        write_table_shards(str(table), str(tmp_path / "x"), image_column="path", caption_column="caption",
                           image_root=str(root))


def test_vqa_v2_round_trip(tmp_path, image_folder):
    root, files = image_folder
    questions = {"questions": [{"question_id": 420, "image_id": 42, "question": "What color is it?"},
                               {"question_id": 70, "image_id": 7, "question": "Is it green?"}]}
    answers = [["red"] * 8 + ["orange", "red"], ["yes"] * 10]
    annotations = {"annotations": [
        {"question_id": q["question_id"], "image_id": q["image_id"], "answer_type": "other",
         "multiple_choice_answer": a[0],
         "answers": [{"answer": x, "answer_confidence": "yes", "answer_id": j + 1} for j, x in enumerate(a)]}
        for q, a in zip(questions["questions"], answers)]}
    for name, data in [("q.json", questions), ("a.json", annotations)]:
        (tmp_path / name).write_text(json.dumps(data))
    (tmp_path / "answers.txt").write_text("red\nyes\nno\n")
    write_vqa_shards(str(tmp_path / "q.json"), str(root), str(tmp_path / "out"), annotations=str(tmp_path / "a.json"),
                     answer_list=str(tmp_path / "answers.txt"))
    members, entry = read_tars(str(tmp_path / "out"), "vqa")
    for q, ann in zip(questions["questions"], annotations["annotations"]):
        meta = json.loads(members[f"{q['question_id']}.json"])
        assert meta["question"] == q["question"] and meta["image_id"] == q["image_id"]
        assert meta["answers"] == ann["answers"] and meta["answer_type"] == "other"
        assert members[f"{q['question_id']}.jpg"] == files[q["image_id"]].read_bytes()
    with open(tmp_path / "out" / entry["answer_list"]) as f:
        assert json.load(f) == ["red", "yes", "no"]


def test_easy_vqa_round_trip(tmp_path):
    import easy_vqa
    write_easy_vqa_shards(str(tmp_path), split="test", max_questions=40, seed=5, max_samples=16)
    members, entry = read_tars(str(tmp_path), "easy_vqa_test")
    texts, answers, image_ids = easy_vqa.get_test_questions()
    paths = easy_vqa.get_test_image_paths()
    assert entry["total"] == 40 and len(entry["shards"]) == 3
    for name in (n for n in members if n.endswith(".json")):
        meta = json.loads(members[name])
        i = meta["question_id"]
        assert (meta["question"], meta["image_id"]) == (texts[i], image_ids[i])
        assert [a["answer"] for a in meta["answers"]] == [answers[i]] * 10
        with open(paths[image_ids[i]], "rb") as f:
            assert members[name[:-5] + ".png"] == f.read()
    with open(tmp_path / entry["answer_list"]) as f:
        assert json.load(f) == easy_vqa.get_answers()


def test_video_folder_round_trip(tmp_path):
    videos = tmp_path / "videos"
    videos.mkdir()
    frames = np.zeros((4, 32, 32, 3), np.uint8)
    (videos / "clip1.mp4").write_bytes(encode_mp4(frames))
    (videos / "clip2.avi").write_bytes(b"RIFF....AVI raw bytes are copied, not decoded")
    records = [{"video_id": "clip1", "question": "what moves?", "answer": "nothing"},
               {"video_id": "clip1", "caption": "a black video"},
               {"video_id": "clip2.avi", "caption": ["two", "captions"]}]
    (tmp_path / "ann.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_video_shards(str(videos), str(tmp_path / "out"), annotations=str(tmp_path / "ann.jsonl"))
    members, entry = read_tars(str(tmp_path / "out"), "video")
    assert entry["kind"] == "video" and entry["total"] == 2
    assert members["00000000.mp4"] == (videos / "clip1.mp4").read_bytes()
    assert members["00000001.avi"] == (videos / "clip2.avi").read_bytes()
    meta = json.loads(members["00000000.json"])
    assert meta["captions"] == ["a black video"] and meta["qa"] == [{"question": "what moves?", "answer": "nothing"}]
    assert json.loads(members["00000001.json"])["captions"] == ["two", "captions"]
    assert members["00000001.txt"] == b"two"


def test_synthetic_captions_describe_the_pixels(tmp_path):
    write_synthetic_image_shards(str(tmp_path / "a"), num_scenes=40, captions_per_scene=2, seed=11, max_samples=30)
    members, entry = read_tars(str(tmp_path / "a"), "synthetic")
    assert entry["total"] == 80
    ids = {}
    for name in (n for n in members if n.endswith(".json")):
        key = name[:-5]
        meta, caption = json.loads(members[name]), members[key + ".txt"].decode()
        ids.setdefault(meta["image_id"], set()).add(caption)
        pixels = np.asarray(Image.open(io.BytesIO(members[key + ".jpg"])).convert("RGB")).astype(float)
        for obj in meta["scene"]["objects"]:
            assert f"{obj['size']} {obj['color']} {obj['shape']} {POSITION_PHRASES[obj['position']]}" in caption
            x, y = obj["center"]
            if obj["shape"] == "triangle":
                y += obj["radius"] / 3  # centroid
            seen = pixels[int(y), int(x)]
            nearest = min(COLORS, key=lambda c: np.abs(np.array(COLORS[c]) - seen).sum())
            assert nearest == obj["color"], (key, obj, seen)
        answers = {qa["question"]: qa["answer"] for qa in meta["qa"]}
        assert answers["how many shapes are there?"] == str(len(meta["scene"]["objects"]))
    assert len(ids) == 40 and all(len(c) == 2 for c in ids.values())
    write_synthetic_image_shards(str(tmp_path / "b"), num_scenes=40, captions_per_scene=2, seed=11, max_samples=30)
    for shard in entry["shards"]:  # deterministic: byte-identical shards for the same seed
        assert (tmp_path / "a" / shard["file"]).read_bytes() == (tmp_path / "b" / shard["file"]).read_bytes()


def test_synthetic_video_moves_as_captioned(tmp_path):
    import av
    write_synthetic_video_shards(str(tmp_path), num_videos=6, seed=2, num_frames=16, size=64)
    members, _ = read_tars(str(tmp_path), "synthetic_video")
    for name in (n for n in members if n.endswith(".mp4")):
        meta = json.loads(members[name[:-4] + ".json"])
        with av.open(io.BytesIO(members[name])) as container:
            frames = [f.to_ndarray(format="rgb24").astype(float) for f in container.decode(video=0)]
        assert len(frames) == 16 and frames[0].shape == (64, 64, 3)
        target = np.array(COLORS[meta["motion"]["color"]])
        centroids = []
        for frame in (frames[0], frames[-1]):
            ys, xs = np.nonzero(np.abs(frame - target).sum(-1) < 90)
            centroids.append((xs.mean(), ys.mean()))
        dx, dy = np.subtract(centroids[1], centroids[0])
        moved = {"right": dx, "left": -dx, "down": dy, "up": -dy}[meta["motion"]["direction"]]
        assert moved > 20, (meta, centroids)
        assert members[name[:-4] + ".txt"].decode().endswith(f"moving {meta['motion']['direction']}")
    write_synthetic_video_shards(str(tmp_path / "again"), num_videos=6, seed=2, num_frames=16, size=64)
    shard = "synthetic_video-000000.tar"
    assert (tmp_path / shard).read_bytes() == (tmp_path / "again" / shard).read_bytes()


def test_rolling_by_bytes_and_unique_keys(tmp_path):
    blob = bytes(3000)  # 512 header + 3072 data per member
    with ShardWriter(str(tmp_path), "roll", kind="image-text", created_by="test", max_samples=100,
                     max_bytes=3 * 4096) as writer:
        for i in range(7):
            writer.write({"__key__": f"k{i}", "bin": blob})
    assert [s["samples"] for s in writer.entry["shards"]] == [3, 3, 1]
    assert tar_names(str(tmp_path / "roll-000001.tar")) == ["k3.bin", "k4.bin", "k5.bin"]
    with pytest.raises(DataError, match="written twice"), \
            ShardWriter(str(tmp_path), "dup", kind="image-text", created_by="test") as writer:
        writer.write({"__key__": "same", "txt": "a"})
        writer.write({"__key__": "same", "txt": "b"})
    assert "dup" not in read_manifest(str(tmp_path))["datasets"]
    with pytest.raises(DataError, match="already exists"):
        ShardWriter(str(tmp_path), "roll", kind="image-text", created_by="test")


def test_make_shards_cli(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    make_shards.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-shards", "synthetic", "--out", str(tmp_path), "--num", "5",
                              "--captions-per-scene", "2", "--shard-size", "4", "--name", "demo"])
    assert args.func(args) == 0
    _, entry = read_tars(str(tmp_path), "demo")
    assert entry["total"] == 10 and [s["samples"] for s in entry["shards"]] == [4, 4, 2]
    assert "make-shards synthetic" in entry["created_by"]
    assert "wrote 10 samples in 3 shard(s)" in capsys.readouterr().out
    args = parser.parse_args(["make-shards", "synthetic", "--kind", "video", "--out", str(tmp_path), "--num", "2",
                              "--num-frames", "8", "--name", "clips", "--shard-bytes", "1MB"])
    assert args.func(args) == 0
    assert read_manifest(str(tmp_path))["datasets"]["clips"]["kind"] == "video"

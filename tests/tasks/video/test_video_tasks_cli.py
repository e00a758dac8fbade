"""``mplug eval video-retrieval | video-qa | video-caption`` end to end on the demo videos (the real argv
parser and task dispatch, in-process), and the data sets' own annotation formats read from a video folder."""
import csv
import json
import os

import numpy as np
import pytest

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.cli import main
from mplug_pretrain.config import config_from_dict
from mplug_pretrain.data.synthetic.videos import (
    encode_mp4,
    motion_captions,
    render_motion_frames,
    sample_motion,
)
from mplug_pretrain.demo.shards import ensure_demo_shards
from mplug_pretrain.tasks.video import qa as video_qa_task
from mplug_pretrain.tasks.video import retrieval as video_retrieval_task
from mplug_pretrain.tasks.video.qa import load_video_mapping, read_qa_annotations
from mplug_pretrain.tasks.video.retrieval import read_caption_annotations
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.usefixtures("one_thread")


FAST = ["eval.annotations=null", "eval.video_root=null", "eval.num_frames=2", "eval.num_workers=0"]


@pytest.fixture(scope="module")
def videos():
    return ensure_demo_shards(os.path.join(REPO_ROOT, "data_shards"))["video"]


def run_cli(task: str, config: str, model_dir: str, out, *overrides: str) -> dict:
    argv = ["eval", task, "--config", os.path.join(REPO_ROOT, "configs", config), "--checkpoint", model_dir,
            "--out", str(out), *overrides]
    assert main(argv) == 0
    with open(out) as f:
        return json.load(f)


def test_cli_video_retrieval(tmp_path, model_dir, videos):
    m = run_cli("video-retrieval", "video_msrvtt.yaml", model_dir, tmp_path / "m.json", *FAST,
                f"eval.shards={videos}", "eval.k_test=3")
    assert (m["task"], m["num_videos"], m["num_texts"]) == ("video-retrieval", 96, 288)
    assert m["videos_skipped"] == 0
    assert (m["rerank_score"], m["k_test"], m["num_frames"]) == ("itm+itc", 3, 2)
    for key in ("txt_r1", "txt_r5", "txt_r10", "vid_r1", "vid_r5", "vid_r10"):
        assert 0.0 <= m[key] <= 100.0 and 0.0 <= m["itc"][key] <= 100.0
    assert m["chance"]["vid_r1"] == pytest.approx(100 / 96)
    assert m["chance"]["txt_r1"] == pytest.approx(100 * 3 / 288)


def test_cli_video_qa(tmp_path, model_dir, videos):
    m = run_cli("video-qa", "video_qa.yaml", model_dir, tmp_path / "m.json", *FAST, "eval.answer_list=null",
                f"eval.shards={videos}", "eval.rank_k=3", "eval.batch_size=48")
    assert (m["task"], m["num_videos"], m["num_questions"], m["inference"]) == ("video-qa", 96, 384, "rank")
    # the demo questions ask for direction, colour, shape and size: 4 + 6 + 3 + 2 distinct answers
    assert m["answer_list_size"] == 15 and m["answers_outside_list"] == 0
    assert m["predictions"] == str(tmp_path / "m.video_qa_predictions.json")  # named after --out: no overwrites
    with open(m["predictions"]) as f:
        predictions = json.load(f)
    assert len(predictions) == 384
    right = sum(p["prediction"] == p["answer"] for p in predictions)
    assert m["accuracy"] == pytest.approx(100.0 * right / 384)


def test_cli_video_caption(tmp_path, model_dir, videos, monkeypatch):
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no Java: eval.caption_metrics=cider needs none
    m = run_cli("video-caption", "video_caption.yaml", model_dir, tmp_path / "m.json", *FAST,
                f"eval.shards={videos}", "eval.generation.beam_size=2",
                "eval.generation.max_length=5", "eval.generation.min_length=1",
                "eval.batch_size=48", "eval.caption_metrics=cider")
    assert (m["task"], m["num_videos"], m["num_scored"]) == ("video-caption", 96, 96)
    assert m["prompt"] == "a video of"
    assert m["caption_metrics"] == "cider" and m["CIDEr"] >= 0.0
    assert m["predictions"] == str(tmp_path / "m.video_caption_predictions.json")  # named after --out
    with open(m["predictions"]) as f:
        assert len(json.load(f)) == 96


def test_cider_only_equals_cider_d_on_ptb_tokens():
    """The CIDEr-only scorer (eval.caption_metrics=cider, no Java) against the project's CIDEr-D on the words of
    the Java PTB tokenizer."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    from mplug_pretrain.metrics.captions import cider_without_java
    from mplug_pretrain.metrics.cider_d import cider_d
    predictions = {"v1": "A red circle moves left.", "v2": "a small blue square",
                   "v3": "something else entirely"}
    references = {"v1": ["a red circle moving left", "the red circle goes to the left"],
                  "v2": ["a small blue square moving up", "A blue square, small, moves up."],
                  "v3": ["a large green triangle going down"]}
    tokenized = PTBTokenizer().tokenize(
        {("ref", v): [{"caption": c} for c in references[v]] for v in predictions}
        | {("res", v): [{"caption": predictions[v]}] for v in predictions})
    hyps = [tokenized[("res", v)][0] for v in predictions]
    expected, _ = cider_d(hyps, [tokenized[("ref", v)] for v in predictions])
    assert cider_without_java(predictions, references)["CIDEr"] == pytest.approx(expected, abs=1e-9)


@pytest.fixture(scope="module")
def video_folder(module_mktemp):
    """video0.mp4 .. video2.mp4 and their captions, as a downloaded data set would lie on disk."""
    folder = module_mktemp("videos")
    captions = {}
    for i in range(3):
        rng = np.random.default_rng(i)
        motion = sample_motion(rng)
        (folder / f"video{i}.mp4").write_bytes(encode_mp4(render_motion_frames(motion, 6, 64, rng)))
        captions[f"video{i}"] = motion_captions(motion)
    return folder, captions


def test_msrvtt_jsonl_and_csv_with_a_missing_video(tmp_path, model_dir, video_folder):
    folder, captions = video_folder
    lines = [{"clip_name": v, "caption": c[0]} for v, c in captions.items()]
    lines.append({"clip_name": "video9", "caption": "gone"})  # no such file
    (tmp_path / "msrvtt_test.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with open(tmp_path / "jsfusion.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "vid_key", "video_id", "sentence"])
        for i, line in enumerate(lines):
            writer.writerow([f"ret{i}", f"msr{i}", line["clip_name"], line["caption"]])
    expected = [(v, [c[0]], []) for v, c in captions.items()] + [("video9", ["gone"], [])]
    assert read_caption_annotations(str(tmp_path / "msrvtt_test.jsonl")) == expected
    assert read_caption_annotations(str(tmp_path / "jsfusion.csv")) == expected
    annotations = str(tmp_path / "msrvtt_test.jsonl")
    cfg = config_from_dict({"eval": {"annotations": annotations, "video_root": str(folder), "num_frames": 2,
                                     "k_test": 2, "num_workers": 0}})
    m = video_retrieval_task.run(cfg, model_dir, out=str(tmp_path / "m.json"))
    assert (m["num_videos"], m["num_texts"], m["skip_reasons"]) == (3, 3, {"missing_video": 1})


def test_vatex_records_merge_and_name_their_files(tmp_path):
    vatex = [{"videoID": "abc_000010_000020", "enCap": ["one", "two"], "chCap": ["x"]},
             {"videoID": "def_000000_000010", "enCap": ["three"]}]
    (tmp_path / "vatex.json").write_text(json.dumps(vatex))
    assert read_caption_annotations(str(tmp_path / "vatex.json")) == [
        ("abc_000010_000020", ["one", "two"], []), ("def_000000_000010", ["three"], [])]


def test_msrvtt_qa_and_msvd_qa_formats(tmp_path, model_dir, video_folder):
    folder, _ = video_folder
    questions = [{"video_id": i, "question": q, "answer": a, "id": n}
                 for n, (i, q, a) in enumerate([(0, "what moves?", "circle"), (1, "what colour?", "red"),
                                                (0, "which way?", "left"), (2, "how big?", "small")])]
    (tmp_path / "test_qa.json").write_text(json.dumps(questions))
    msrvtt = read_qa_annotations(str(tmp_path / "test_qa.json"), "video{}")
    assert [(ref, len(qa)) for ref, _, qa in msrvtt] == [("video0", 2), ("video1", 1), ("video2", 1)]
    (tmp_path / "youtube_mapping.txt").write_text("video0 vid0\nvideo1 vid1\nvideo2 vid2\n")
    mapping = load_video_mapping(str(tmp_path / "youtube_mapping.txt"))
    msvd = read_qa_annotations(str(tmp_path / "test_qa.json"), "vid{}", mapping)
    assert msvd == msrvtt
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"circle": 0, "red": 1, "left": 2, "blue": 3}))  # mPLUG's {answer: label}
    cfg = config_from_dict({"eval": {"annotations": str(tmp_path / "test_qa.json"), "video_root": str(folder),
                                     "video_name_format": "video{}", "answer_list": str(answers),
                                     "num_frames": 2, "num_workers": 0}})
    m = video_qa_task.run(cfg, model_dir, out=str(tmp_path / "m.json"))
    assert (m["num_videos"], m["num_questions"]) == (3, 4)
    assert (m["answer_list_size"], m["answers_outside_list"]) == (4, 1)  # "small" is not in the list
    with open(m["predictions"]) as f:
        assert {p["prediction"] for p in json.load(f)} <= {"circle", "red", "left", "blue"}

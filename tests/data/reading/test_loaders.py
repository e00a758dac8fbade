"""VQA, caption-evaluation and video loaders: batch contracts against the source data."""
import collections
import json
import tarfile

import numpy as np
import pytest
import torch

from mplug_pretrain.data.reading.loader_spec import LoaderSpec
from mplug_pretrain.data.reading.pipeline import (
    build_caption_eval_loader,
    build_video_loader,
    build_vqa_loader,
)
from mplug_pretrain.data.transforms import CLIP_MEAN, CLIP_STD
from mplug_pretrain.data.writers.easy_vqa import write_easy_vqa_shards
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards, write_synthetic_video_shards
from tests.data.shard_samples import jpeg_bytes


def real(batches, key):
    return [v for b in batches for v, pad in zip(b[key], b["is_pad"].tolist()) if not pad]


def test_vqa_loader_on_easy_vqa(tmp_path, tokenizer):
    import easy_vqa
    write_easy_vqa_shards(str(tmp_path), split="test", max_questions=30, seed=1, max_samples=10)
    texts, answers, _ = easy_vqa.get_test_questions()
    spec = LoaderSpec(str(tmp_path / "easy_vqa_test-{000000..000002}.tar"), batch_size=8, num_workers=2, seed=4)
    lo = build_vqa_loader(spec, tokenizer, image_size=32, max_text_len=12, augment=True)
    assert lo.answer_list == easy_vqa.get_answers()
    batches = list(lo)
    assert len(batches) == lo.num_batches
    qids = real(batches, "question_id")
    assert len(qids) == len(set(qids)) == 30
    for b in batches:
        assert b["image"].shape == (8, 3, 32, 32) and b["question_input_ids"].shape[0] == 8
        assert b["question_input_ids"].shape == b["question_attention_mask"].shape
        assert int(b["question_input_ids"][0, 0]) == 101
        for qid, q, ans, w, raw in zip(b["question_id"], b["question"], b["answers"], b["answer_weights"],
                                       b["all_answers"]):
            assert q == texts[qid] and raw == [answers[qid]] * 10
            assert ans == [answers[qid]] and w == [1.0]


def test_vqa_answer_weights_follow_annotator_agreement(tmp_path, tokenizer):
    raw = ["2", "two", "2", "3", "2", "2", "two", "2", "2", "4"]
    with ShardWriter(str(tmp_path), "v", kind="vqa", created_by="test") as writer:
        writer.write({"__key__": "q1", "jpg": jpeg_bytes((1, 2, 3)),
                      "json": {"question_id": 1, "question": "how many?", "image_id": 5,
                               "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": i}
                                           for i, a in enumerate(raw)]}})
    (batch,) = list(build_vqa_loader(LoaderSpec.evaluation(str(tmp_path / "v-000000.tar"), batch_size=1), tokenizer,
                                     image_size=16, max_text_len=8, augment=False))
    counts = collections.Counter(raw)
    assert batch["answers"][0] == ["2", "two", "3", "4"]
    assert batch["answer_weights"][0] == [counts[a] / 10 for a in ["2", "two", "3", "4"]]
    assert batch["all_answers"][0] == raw and batch["image_id"].tolist() == [5]


def test_caption_eval_loader_two_ranks(tmp_path):
    write_synthetic_image_shards(str(tmp_path), num_scenes=11, captions_per_scene=3, layout="image", seed=3)
    with tarfile.open(tmp_path / "synthetic-000000.tar") as tar:
        refs = {json.loads(tar.extractfile(m).read())["image_id"]: json.loads(tar.extractfile(m).read())["captions"]
                for m in tar.getmembers() if m.name.endswith(".json")}
    seen = {}
    lengths = []
    for rank in range(2):
        spec = LoaderSpec.evaluation(str(tmp_path / "synthetic-000000.tar"), batch_size=4, num_workers=2, rank=rank,
                                     world_size=2)
        batches = list(build_caption_eval_loader(spec, image_size=32))
        lengths.append(len(batches))
        for image_id, captions in zip(real(batches, "image_id"), real(batches, "captions")):
            assert int(image_id) not in seen
            seen[int(image_id)] = captions
    assert lengths[0] == lengths[1] and seen == refs


def test_video_loader_raw_bytes_and_frames(tmp_path):
    write_synthetic_video_shards(str(tmp_path), num_videos=3, seed=9, num_frames=8, size=32)
    with tarfile.open(tmp_path / "synthetic_video-000000.tar") as tar:
        source = {m.name[:-4]: tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".mp4")}
    spec = LoaderSpec.evaluation(str(tmp_path / "synthetic_video-000000.tar"), batch_size=2)
    lo = build_video_loader(spec)
    batches = list(lo)
    assert dict(zip(real(batches, "__key__"), real(batches, "video_bytes"))) == source
    assert all(ext == "mp4" for ext in real(batches, "video_ext"))
    assert all(c[0].startswith("a ") and "moving" in c[0] for c in real(batches, "captions"))
    pytest.importorskip("av")
    decoded = list(build_video_loader(spec, num_frames=4, image_size=32))
    assert decoded[0]["video"].shape == (2, 4, 3, 32, 32) and decoded[0]["video"].dtype == torch.float32
    from mplug_pretrain.data.formats.video_frames import decode_frames
    first = decode_frames(source[decoded[0]["__key__"][0]], 4, mode="uniform")
    unnormalized = decoded[0]["video"][0] * torch.tensor(CLIP_STD)[:, None, None] + torch.tensor(CLIP_MEAN)[:, None, None]
    expected = torch.from_numpy(np.ascontiguousarray(first)).permute(0, 3, 1, 2).float() / 255
    assert (unnormalized - expected).abs().max() < 1e-4

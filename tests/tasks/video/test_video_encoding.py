"""A video through an image model: frame tokens concatenated, ITC feature = the frames' mean (checked against
per-frame encoding), and unusable videos in a batch skipped and counted while the rest is evaluated."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.config import config_from_dict
from mplug_pretrain.data.synthetic.videos import (
    encode_mp4,
    motion_captions,
    render_motion_frames,
    sample_motion,
)
from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
from mplug_pretrain.data.writers.shard_writer import ShardWriter
from mplug_pretrain.metrics.retrieval_scoring import TextBank, VisualBank, score_pairs
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.tasks.evaluation import SkipReport
from mplug_pretrain.tasks.video import retrieval as video_retrieval_task
from mplug_pretrain.tasks.video.encoding import (
    FrameSpec,
    VideoRecord,
    decode_records,
    encode_videos,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny").eval()


def clip(seed: int, frames: int = 6) -> tuple[bytes, list[str]]:
    """A real mp4 (moving shape, 64x64) and its captions."""
    rng = np.random.default_rng(seed)
    motion = sample_motion(rng)
    return encode_mp4(render_motion_frames(motion, frames, 64, rng)), motion_captions(motion)


@torch.no_grad()
def test_video_states_are_concatenated_frame_tokens_and_itc_is_the_frame_mean(model):
    frames = torch.randn(2, 3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    states, features = encode_videos(model, frames)
    tokens = [[model.encode_image(frames[b, n][None])[0] for n in range(3)] for b in range(2)]  # each [65, D]
    per_frame = tokens[0][0].shape[0]
    assert states.shape == (2, 3 * per_frame, model.config.text.width)
    for b in range(2):
        for n in range(3):
            frame_part = states[b, n * per_frame:(n + 1) * per_frame]
            torch.testing.assert_close(frame_part, tokens[b][n], atol=1e-5, rtol=0)
        mean = torch.stack([model.itc.vision_proj(t[0]) for t in tokens[b]]).mean(0)
        torch.testing.assert_close(features[b], F.normalize(mean, dim=0), atol=1e-6, rtol=0)
    # what fusion / ITM receive: the three frames' token sequences one after the other
    ids, mask = tokenize(load_tokenizer(), ["a red circle moving left"], 35)
    text_states = model.encode_text(ids, mask)
    bank = VisualBank(states, features)
    text = TextBank(text_states, mask, model.itc.text_features(text_states[:, 0]))
    pipeline = score_pairs(model, bank, text, np.array([0, 1]), np.array([0, 0]), batch_size=2)
    for b in range(2):
        _, fused = model.fuse(torch.cat(tokens[b])[None], None, text_states, mask)
        assert pipeline[b] == pytest.approx(float(model.itm_head(fused[:, 0])[0, 1]), abs=1e-4)


def test_decode_records_skips_bad_videos_and_keeps_order():
    good = [clip(seed)[0] for seed in range(3)]
    records = [VideoRecord("ok0", good[0]), VideoRecord("truncated", good[1][: len(good[1]) // 2]),
               VideoRecord("ok1", good[1]), VideoRecord("empty", b""), VideoRecord("ok2", good[2])]
    for workers in (0, 3):
        skipped = SkipReport()
        spec = FrameSpec(num_frames=4, image_size=32, workers=workers)
        frames, kept = decode_records(records, spec, skipped)
        assert [r.video_id for r in kept] == ["ok0", "ok1", "ok2"]
        assert frames.shape == (3, 4, 3, 32, 32)
        assert skipped.as_dict()["videos_skipped"] == 2 and skipped.reasons == {"corrupt_video": 2}
        assert [e.split(":")[0] for e in skipped.examples] == ["truncated", "empty"]
    alone, _ = decode_records([records[2]], FrameSpec(num_frames=4, image_size=32), SkipReport())
    torch.testing.assert_close(frames[1], alone[0])  # a neighbour's failure does not change a video's frames


def write_video_shard(folder, name: str, samples: list[dict]) -> str:
    with ShardWriter(str(folder), name, kind="video", created_by="test", max_samples=100) as writer:
        for sample in samples:
            writer.write(sample)
    return str(folder / f"{name}-000000.tar")


def test_corrupt_videos_in_a_shard_are_skipped_and_counted(tmp_path, model):
    good = []
    for seed in range(4):
        data, captions = clip(seed + 10)
        good.append({"__key__": f"good{seed}", "mp4": data,
                     "json": {"video_id": f"good{seed}", "captions": captions}})
    truncated = {"__key__": "truncated", "mp4": good[0]["mp4"][:600],
                 "json": {"video_id": "truncated", "captions": ["a cut video"]}}
    empty = {"__key__": "empty", "mp4": b"", "json": {"video_id": "empty", "captions": ["no bytes"]}}
    mixed = write_video_shard(tmp_path, "mixed", [good[0], truncated, good[1], empty, good[2], good[3]])
    clean = write_video_shard(tmp_path, "clean", good)
    settings = {"num_frames": 3, "k_test": 4, "rerank_score": "itm+itc", "batch_size": 3, "num_workers": 0}
    with_bad = video_retrieval_task.evaluate(config_from_dict({"eval": {"shards": mixed, **settings}}), model)
    reference = video_retrieval_task.evaluate(config_from_dict({"eval": {"shards": clean, **settings}}),
                                              model)
    assert with_bad["num_videos"] == 4 and with_bad["num_texts"] == 12
    assert with_bad["videos_skipped"] == 2 and with_bad["skip_reasons"] == {"corrupt_video": 2}
    # the truncated one is named; the zero-byte one is counted by the shard reader, which keeps no names
    assert any(e.startswith("truncated:") for e in with_bad["skipped_examples"])
    for part in ("itc", "chance", None):  # recalls before and after re-ranking, and the chance level
        expected, got = (reference, with_bad) if part is None else (reference[part], with_bad[part])
        keys = [k for k in expected if k.startswith(("txt_r", "vid_r", "r_mean"))]
        assert {k: got[k] for k in keys} == pytest.approx({k: expected[k] for k in keys})

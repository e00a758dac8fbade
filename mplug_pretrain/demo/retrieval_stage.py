"""Zero-shot retrieval figures for ``mplug demo``: the demo's pretrained model on the embedded demo data.

retrieval_demo        image-text retrieval on ``shards["pretrain_val"]`` (250 held-out synthetic scenes x 3
                      captions): ITC top-10 re-ranked by ITM (mPLUG's image protocol, k reduced from 256).
video_retrieval_demo  text-video retrieval on ``shards["video"]`` (96 synthetic clips x 3 captions): 8 uniform
                      frames per clip (paper: n = 8 for retrieval), ITC top-5 re-ranked by ITM + ITC (mPLUG's
                      video protocol, k reduced from 128). Frame order is lost (no temporal modelling: the
                      mean of frame features, frame tokens without time positions), so the direction of
                      motion in a caption is close to invisible; colour, shape and size are not.
The headline statistic is R@1 averaged over the two directions, reported beside its value under a random
ranking (``metrics.retrieval_scoring.chance_recall``). The small k keeps both under a minute on two CPU cores.
"""
from __future__ import annotations

from mplug_pretrain.config import config_from_dict, use_folder_tokenizer

IMAGE_SETTINGS = {"k_test": 10, "rerank_score": "itm", "batch_size": 128, "num_workers": 0}
VIDEO_SETTINGS = {"k_test": 5, "rerank_score": "itm+itc", "num_frames": 8, "frame_sampling": "uniform",
                  "batch_size": 64, "num_workers": 0}


def _r1(recalls: dict, visual_name: str) -> float:
    return (recalls["txt_r1"] + recalls[f"{visual_name}_r1"]) / 2


def _summary(prefix: str, metrics: dict, visual_name: str) -> dict:
    """{prefix}_r1 and _chance, then the detailed recalls: txt_r1/5/10, {visual}_r1/5/10 after re-ranking,
    itc_r1 (the same mean R@1 before re-ranking), k_test."""
    out = {f"{prefix}_r1": _r1(metrics, visual_name), f"{prefix}_chance": _r1(metrics["chance"], visual_name)}
    for side in ("txt", visual_name):
        out.update({f"{prefix}_{side}_r{k}": metrics[f"{side}_r{k}"] for k in (1, 5, 10)})
    out[f"{prefix}_itc_r1"] = _r1(metrics["itc"], visual_name)
    out[f"{prefix}_k_test"] = metrics["k_test"]
    return out


def retrieval_demo(pretrained_dir: str, shards: dict, run_root: str, quick: bool = False) -> dict:
    """-> {"retrieval_r1", "retrieval_chance" (both %), the detailed recalls (``_summary``)}. Evaluation only:
    ``run_root`` and ``quick`` are unused."""
    from mplug_pretrain.tasks.evaluation import load_eval_model
    from mplug_pretrain.tasks.retrieval import evaluate as retrieval_task
    cfg = config_from_dict({"eval": {"shards": shards["pretrain_val"], **IMAGE_SETTINGS}})
    use_folder_tokenizer(cfg, pretrained_dir)  # the demo's vocabulary, saved with the model
    metrics = retrieval_task.evaluate(cfg, load_eval_model(cfg, pretrained_dir))
    return _summary("retrieval", metrics, "img")


def video_retrieval_demo(pretrained_dir: str, shards: dict, run_root: str, quick: bool = False) -> dict:
    """-> {"video_retrieval_r1", "video_retrieval_chance" (both %), "videos_skipped", detailed recalls}."""
    from mplug_pretrain.tasks.evaluation import load_eval_model
    from mplug_pretrain.tasks.video import retrieval as video_retrieval_task
    cfg = config_from_dict({"eval": {"shards": shards["video"], **VIDEO_SETTINGS}})
    use_folder_tokenizer(cfg, pretrained_dir)
    metrics = video_retrieval_task.evaluate(cfg, load_eval_model(cfg, pretrained_dir))
    return {**_summary("video_retrieval", metrics, "vid"), "videos_skipped": metrics["videos_skipped"],
            "video_retrieval_num_frames": metrics["num_frames"]}

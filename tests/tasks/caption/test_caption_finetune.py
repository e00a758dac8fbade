"""`mplug finetune caption` end to end through the CLI (cached-feature XE stage, then SCST; pycocoevalcap
metrics of the final model; stage skipping on resume). That SCST after XE raises held-out CIDEr-D is
checked on `mplug demo`'s caption stage, in tests/demo/test_demo.py (one shared end-to-end run)."""
import json
import os

import pytest

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.data.writers.synthetic import write_synthetic_image_shards
from mplug_pretrain.demo.shards import ensure_demo_shards
from tests.helpers import REPO_ROOT, read_log, run_mplug

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # a shared 2-core machine: OpenMP spinning makes 2 threads far slower


@pytest.fixture(scope="module")
def shards():
    return ensure_demo_shards(os.path.join(REPO_ROOT, "data_shards"))


@pytest.fixture(scope="module")
def small_shards(module_mktemp):
    folder = module_mktemp("small_shards")
    train = write_synthetic_image_shards(str(folder), num_scenes=16, captions_per_scene=2, layout="pair", seed=8,
                                         name="train")
    val = write_synthetic_image_shards(str(folder), num_scenes=4, captions_per_scene=3, layout="image", seed=9,
                                       name="val")
    return {"train": str(folder / train["shards"][0]["file"]), "val": str(folder / val["shards"][0]["file"])}


@pytest.mark.slow  # XE (cached features) + SCST + pycocoevalcap in subprocesses: ~35 s
def test_finetune_caption_cli_runs_xe_then_scst_and_evaluates(tmp_path, small_shards, model_dir):
    stages = ("caption.stages=[{name: xe, steps: 3, freeze_vision: true, cached_features: true}, "
              "{name: scst, objective: scst, steps: 2, batch_size: 4, warmup_steps: 0}]")
    args = ["finetune", "caption", "--config", os.path.join(REPO_ROOT, "configs", "caption_demo.yaml"),
            f"init_from={model_dir}", f"caption.train_shards={small_shards['train']}",
            f"caption.val_shards={small_shards['val']}", stages, "caption.final_eval=coco", "data.batch_size=4",
            "caption.generation.max_length=6", "run.eval_every_steps=2", f"run.output_dir={tmp_path}", "run.name=cap"]
    proc = run_mplug(args, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "cap"
    xe_log, scst_log = read_log(run_dir / "1_xe"), read_log(run_dir / "2_scst")
    xe_val, scst_val = ([r for r in log if "val_cider_d" in r] for log in (xe_log, scst_log))
    xe_log, scst_log = ([r for r in log if "loss" in r] for log in (xe_log, scst_log))
    assert [r["step"] for r in xe_log] == [1, 2, 3] and [r["step"] for r in scst_log] == [1, 2]
    assert all(r["loss"] > 1.0 for r in xe_log)  # a real cross-entropy over the 30522-word vocabulary
    assert all("loss_reward" in r and r["loss_reward"] >= 0 for r in scst_log)
    assert "lr_vision_decay" not in xe_log[0]  # the frozen ViT is out of the optimizer
    assert "lr_vision_decay" in scst_log[0]  # ... and back in the end-to-end stage
    caches = os.listdir(run_dir / "feature_cache")
    assert len(caches) == 1 and os.path.isfile(run_dir / "feature_cache" / caches[0] / "meta.json")
    for stage in ("1_xe", "2_scst"):
        assert os.path.isfile(run_dir / stage / "model" / "model.safetensors")
        with open(run_dir / stage / "model" / "caption_generation.json") as f:
            assert json.load(f)["prompt"] == "a picture of"
    with open(run_dir / "metrics.json") as f:
        metrics = json.load(f)
    for key in ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "cider_d_xe", "cider_d_scst", "sample_cider_d_xe",
                "sample_cider_d_scst"):
        assert isinstance(metrics[key], float), key
    with open(run_dir / "metrics.caption_predictions.json") as f:
        assert len(json.load(f)) == 4
    # validated while training (run.eval_every_steps=2) on the live model: at each stage's last step its CIDEr-D
    # equals the stage's held-out score of its exported model
    assert [r["step"] for r in xe_val] == [2, 3] and [r["step"] for r in scst_val] == [2]
    assert xe_val[-1]["val_cider_d"] == pytest.approx(metrics["cider_d_xe"], abs=1e-9)
    assert scst_val[-1]["val_cider_d"] == pytest.approx(metrics["cider_d_scst"], abs=1e-9)
    assert all(r["val_num_images"] == 4 for r in xe_val + scst_val)
    printed = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert printed["CIDEr"] == metrics["CIDEr"]
    assert f"[finetune] final model: {run_dir / '2_scst' / 'model'}\n" in proc.stderr  # where to point eval

    # finished stages are skipped on resume: no step is trained again
    proc = run_mplug([*args, "caption.final_eval=none", "--resume", "auto"], env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r for r in read_log(run_dir / "1_xe") if "loss" in r] == xe_log
    assert [r for r in read_log(run_dir / "2_scst") if "loss" in r] == scst_log
    assert "[train] step" not in proc.stdout

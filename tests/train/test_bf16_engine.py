"""bf16 under real DeepSpeed (CPU, 2 ranks, gloo), ZeRO-2 and ZeRO-3: the precision policy of docs/precision.md
checked end to end by tests/train/bf16_engine_worker.py (one launch per stage, shared by the
tests below). Each check is against an independent computation made in the worker: an fp32 EMA recomputed from
the online fp32 masters step by step, the masters themselves for the export, forward hooks for the dtypes."""
import json
import os
import subprocess

import pytest

from tests.helpers import REPO_ROOT, forked_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def worker_results(request, module_mktemp, demo_shards):
    stage = request.param
    out = module_mktemp(f"bf16_z{stage}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)  # this checkout, not an installed copy
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO_ROOT, ".cache", "torch_extensions"))
    proc = subprocess.run(forked_ranks(2, os.path.join(REPO_ROOT, "tests", "train", "bf16_engine_worker.py"),
                                       str(stage), str(out), demo_shards["pretrain_train"], demo_shards["tokenizer"]),
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = []
    for rank in (0, 1):
        with open(out / f"result_z{stage}_rank{rank}.json") as f:
            results.append(json.load(f))
    return results


def test_momentum_encoders_follow_an_fp32_ema_of_the_masters(worker_results):
    """DeepSpeed's bf16 mode kept the momentum towers in bf16, where (1 - 0.995) * (θ - θm) rounds away."""
    for r in worker_results:
        assert r["momentum_dtypes"] == ["torch.float32"], r["momentum_dtypes"]
        assert r["momentum_max_rel_diff"] <= 1e-6, r["momentum_max_rel_diff"]
        assert r["queue_dtype"] == "torch.float32"


def test_fp32_islands_and_bf16_compute_without_outside_autocast(worker_results):
    for r in worker_results:
        assert not r["autocast_outside"]
        assert r["matmul_dtypes"] == ["torch.bfloat16"]  # the compute is bf16 (the engine's autocast)
        for name in ("layer_norm", "itc_logits", "itm_logits", "loss"):
            assert r["dtypes"][name] == ["torch.float32"], (name, r["dtypes"])


def test_export_is_the_fp32_masters(worker_results):
    r = worker_results[0]
    assert r["export_dtypes"] == ["torch.float32"]
    assert r["export_compared"] > 50
    assert r["export_max_abs_diff"] == 0.0
    assert r["export_momentum_max_abs_diff"] <= 1e-6


def test_a_nan_batch_on_one_rank_is_skipped_on_all_and_leaves_the_queues(worker_results):
    for r in worker_results:
        assert r["nan_step_skipped"] and r["nan_counted"] == 1
        assert r["queues_unchanged"]
        assert all(grew == 8 for grew in r["queue_grew"]), r["queue_grew"]  # 2 ranks x 4 rows per finite step


def test_temperature_is_clamped_on_the_master(worker_results):
    for r in worker_results:
        assert r["temp_master_before_clamp"] == pytest.approx(0.9)
        assert r["temp_master_after_clamp"] == pytest.approx(0.5)

"""ZeRO 1-2 on one rank run as ZeRO-0 (config.engine_zero_stage), with torch's foreach gradient clipping
(train/engine.use_foreach_clipping): the stage rule, and a real `mplug pretrain` on the demo shards giving the
losses and gradient norms of the same run kept at ZeRO-2 (distributed.single_rank_zero0=false), clipping active."""
import pytest

from mplug_pretrain.config import engine_zero_stage, load_config
from tests.helpers import read_log, run_mplug, tiny_pretrain_args


@pytest.mark.parametrize(("overrides", "world", "partitioned", "stage"), [
    (["distributed.zero_stage=2"], 1, False, 0),
    (["distributed.zero_stage=1"], 1, False, 0),
    (["distributed.zero_stage=2"], 2, False, 2),
    (["distributed.zero_stage=3"], 1, False, 3),
    (["distributed.zero_stage=2"], 1, True, 2),  # resuming a checkpoint written partitioned
    (["distributed.zero_stage=2", "distributed.offload_optimizer=true"], 1, False, 2),
    (["distributed.zero_stage=2", "distributed.single_rank_zero0=false"], 1, False, 2),
])
def test_engine_stage(overrides, world, partitioned, stage):
    cfg = load_config(None, overrides, check_paths=False)
    assert engine_zero_stage(cfg, world, partitioned) == stage


@pytest.mark.slow  # two single-rank DeepSpeed runs of 3 steps: ~90 s on the shared 2-core machine
def test_zero2_on_one_rank_runs_as_zero0_with_the_losses_and_norms_of_zero2(tmp_path, demo_shards):
    logs, outputs = {}, {}
    for name, keep in (("as_zero0", "true"), ("kept_zero2", "false")):
        args = tiny_pretrain_args(tmp_path, demo_shards, name, steps=3, extra=[
            "distributed.zero_stage=2", f"distributed.single_rank_zero0={keep}", "optim.grad_clip=0.05",
            "run.log_every=2", "data.num_workers=0", "distributed.precision=fp32"])
        proc = run_mplug(["pretrain", *args])
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs[name], outputs[name] = read_log(tmp_path / name), proc.stdout + proc.stderr
    assert "runs as ZeRO-0" in outputs["as_zero0"] and "runs as ZeRO-0" not in outputs["kept_zero2"]
    zero0, zero2 = logs["as_zero0"], logs["kept_zero2"]
    assert [r["step"] for r in zero0] == [r["step"] for r in zero2] == [1, 2, 3]  # a record per step (log_every 2)
    for a, b in zip(zero0, zero2):
        assert b["grad_norm"] > 0.05  # the clip acts on every step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        for key in ("loss", "loss_itc", "loss_itm", "loss_mlm", "loss_prefixlm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a["step"])

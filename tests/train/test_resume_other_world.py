"""Resume on another number of ranks and ZeRO stage (train/world_change.py, train/reshard.py,
data/reading/resplit.py), end to end with real processes: 2 ranks ZeRO-2 -> 1 rank ZeRO-3 -> 2 ranks ZeRO-2.

Two epochs of 32 samples with a global batch of 8 (4 steps an epoch): the 1-rank part resumes in the middle of
epoch 0 (its rest re-split onto one rank, accumulation 2 keeping the global batch), the last part in the middle of
epoch 1 (begun on one rank). The sample-key records then hold every key once per epoch, and the LR and samples
seen of every step equal those of the uninterrupted 2-rank run."""
from collections import Counter

import pytest

from tests.data.shard_samples import write_simple_shards
from tests.helpers import read_log, run_mplug, tiny_pretrain_args

pytestmark = pytest.mark.slow

STEPS = 8


def _args(tmp_path, shards, name, stage, extra=()):
    return tiny_pretrain_args(tmp_path, {"pretrain_train": shards}, name, steps=STEPS, extra=[
        "run.checkpoint_every_steps=2", f"distributed.zero_stage={stage}", "run.record_sample_keys=true",
        "run.keep_last=8", *extra], vocab="bert")  # write_simple_shards' words are not the demo's


def _run(args, nproc):
    proc = run_mplug(["pretrain", "--nproc", str(nproc), *args])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_two_ranks_to_one_at_zero3_and_back_sees_each_sample_once_per_epoch(tmp_path):
    from mplug_pretrain.train.sample_keys import read_keys
    shards, keys = write_simple_shards(str(tmp_path / "shards"), [8, 8, 8, 8])
    run_dir = tmp_path / "run"

    _run(_args(tmp_path, shards, "run", stage=2), nproc=2)  # uninterrupted: the reference LR and samples
    straight = {r["step"]: r for r in read_log(run_dir)}

    one = _run(_args(tmp_path, shards, "run", stage=3, extra=["--resume", "step00000002", "run.discard_newer=true"]),
               nproc=1)
    assert "written by 2 rank(s) at ZeRO-2, resumed on 1 at ZeRO-3" in one.stdout
    assert "global batch 8 kept with data.batch_size 4 x optim.grad_accum_steps 2" in one.stdout
    assert "the rest of the epoch is re-split over 1 x 1" in one.stdout

    two = _run(_args(tmp_path, shards, "run", stage=2, extra=["--resume", "step00000006", "run.discard_newer=true"]),
               nproc=2)
    assert "written by 1 rank(s) at ZeRO-3, resumed on 2 at ZeRO-2" in two.stdout

    records = read_keys(str(run_dir))
    assert {(r["rank"], r["step"]) for r in records if r["step"] <= 2} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    assert {r["rank"] for r in records if 2 < r["step"] <= 6} == {0}  # the one-rank part
    for epoch in (0, 1):
        seen = Counter(k for r in records if r["epoch"] == epoch for k in r["keys"])
        assert sorted(seen) == sorted(keys) and set(seen.values()) == {1}, (epoch, seen)

    log = read_log(run_dir)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    for record in log:
        reference = straight[record["step"]]
        assert record["samples_seen"] == reference["samples_seen"] == 8 * record["step"]
        lrs = {k: v for k, v in record.items() if k.startswith("lr_")}
        assert lrs and lrs == pytest.approx({k: reference[k] for k in lrs}, rel=1e-12), record["step"]
        assert all(abs(v) < 1e4 for k, v in record.items() if k.startswith("loss")), record
    assert (run_dir / "model" / "model.safetensors").is_file()

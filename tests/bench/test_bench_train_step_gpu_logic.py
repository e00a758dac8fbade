"""The CUDA train-step bench's logic on CPU: the largest-batch search doubles until the first
torch.cuda.OutOfMemoryError and keeps the last batch that fitted; the tiled batch has the preset's
resolution and distinct image ids. (The GPU figures themselves need a GPU.)"""
import pytest
import torch

from mplug_pretrain.bench.train_step_gpu import _tiled_batch, largest_batch


def _fits_up_to(limit, calls):
    def measure(preset, stage, ckpt, batch):
        calls.append(batch)
        if batch > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at batch {batch}")
        return {"preset": preset, "zero_stage": stage, "grad_checkpointing": ckpt, "batch_per_rank": batch}
    return measure


@pytest.mark.parametrize("limit, best, oom_at", [(100, 64, 128), (8, 8, 16), (5000, 1024, None)])
def test_largest_batch_doubles_until_out_of_memory(limit, best, oom_at):
    calls = []
    row = largest_batch("base", 2, False, start=8, limit=1024, measure=_fits_up_to(limit, calls))
    assert row["batch_per_rank"] == best and row["oom_at"] == oom_at
    assert calls == row["tried_batches"] == [b for b in (8, 16, 32, 64, 128, 256, 512, 1024) if b <= (oom_at or 1024)]


def test_nothing_fits_gives_none():
    assert largest_batch("large", 0, False, start=8, measure=_fits_up_to(4, [])) is None


def test_other_errors_are_not_swallowed():
    def broken(*_):
        raise RuntimeError("not an OOM")
    with pytest.raises(RuntimeError, match="not an OOM"):
        largest_batch("base", 2, False, measure=broken)


def test_tiled_batch_shape_and_ids(demo_shards):
    batch = _tiled_batch("tiny", 40, "cpu")
    assert batch["image"].shape == (40, 3, 64, 64)
    assert batch["input_ids"].shape[0] == 40
    assert torch.equal(batch["image"][16], batch["image"][0])  # tiled from one real batch of 16
    if "image_id" in batch:
        assert len(set(batch["image_id"].tolist())) == 40


def test_tiled_batch_text_is_padded_to_the_counted_length(demo_shards):
    from mplug_pretrain.bench.train_step_gpu import TEXT_TOKENS
    batch = _tiled_batch("tiny", 20, "cpu")
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (20, TEXT_TOKENS)
    assert batch["is_pad"].device.type == "cpu"


def test_queues_are_filled_before_timing():
    from mplug_pretrain.bench.train_step_gpu import _fill_queues
    from mplug_pretrain.models.mplug import MPLUG
    from mplug_pretrain.models.presets import get_preset_config
    model = MPLUG(get_preset_config("tiny"))
    _fill_queues(model)
    itc = model.itc
    assert int(itc.queue_count) == itc.queue_size
    torch.testing.assert_close(itc.image_queue.norm(dim=0), torch.ones(itc.queue_size))
    assert len(set(itc.idx_queue.tolist())) == itc.queue_size


def test_every_case_runs_in_a_process_of_its_own(monkeypatch, tmp_path):
    import json
    import subprocess

    from mplug_pretrain.bench import train_step_gpu
    launched = []
    real_run = subprocess.run

    def fake_run(cmd, **kwargs):
        if "--worker" not in cmd:  # the machine description's own commands
            return real_run(cmd, **kwargs)
        cases = json.loads(cmd[cmd.index("--worker") + 1])
        launched.append(cases)
        code = 1 if cases[0][0] == "large" and cases[0][1] == 3 else 0  # one case dies of a CUDA error
        if code == 0:
            with open(cmd[cmd.index("--rows") + 1], "w") as f:
                json.dump([{"preset": cases[0][0], "zero_stage": cases[0][1]}], f)
        return subprocess.CompletedProcess(cmd, code, "", "CUDA error: an illegal memory access")
    monkeypatch.setattr(train_step_gpu.subprocess, "run", fake_run)
    result = train_step_gpu.run(str(tmp_path / "out.json"))
    assert launched == [[list(case)] for case in train_step_gpu.CASES]
    assert len(result["rows"]) == len(train_step_gpu.CASES) - 2  # both large ZeRO-3 cases failed, the rest kept
    assert result["complete"] is False and result["failed_cases"] == [["large", 3, False], ["large", 3, True]]


def test_cases_from_env_reads_checkpointing_compile_and_zero_options():
    from mplug_pretrain.bench.train_step_gpu import cases_from_env
    assert cases_from_env("base:2:off:eager:keep, base:2:selective:compiled,large:3:on") == [
        ("base", 2, False, False, False), ("base", 2, "selective", True, True), ("large", 3, True)]
    assert cases_from_env("") is None
    for bad in ("base:2:partial", "base:2:off:jit", "base:2:off:eager:shard", "base:2:off:eager:keep:x"):
        with pytest.raises(ValueError, match="MPLUG_BENCH_GPU_CASES"):
            cases_from_env(bad)


def test_a_case_that_fails_to_compile_keeps_a_row_with_its_error():
    from mplug_pretrain.bench.train_step_gpu import case_row
    seen = []

    def measure(preset, stage, ckpt, batch, compile_, single_rank_zero0):
        seen.append((compile_, single_rank_zero0, batch))
        if compile_:
            raise RuntimeError("torch._dynamo.exc.Unsupported: a graph break")
        return {"preset": preset, "zero_stage": stage, "grad_checkpointing": ckpt, "batch_per_rank": batch}

    row = case_row(("base", 2, False, True, False), start=128, limit=128, measure=measure)
    assert row["compile"] is True and "graph break" in row["error"] and "step_seconds" not in row
    eager = case_row(("base", 2, False), start=128, limit=128, measure=measure)
    assert eager["batch_per_rank"] == 128 and "error" not in eager
    assert seen == [(True, False, 128), (False, True, 128)]  # one batch each: start == limit

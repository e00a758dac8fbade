"""Host syncs per pretraining micro-step (bench/host_syncs.py over the loop's real ``_micro_step`` and
``after_optimizer_step`` on a single-process DeepSpeed engine): our code asks for at most 2 outside the log
step (today 1: the all-rank finiteness flag before backward); DeepSpeed's own optimizer step adds none on one
rank. The counter itself is checked on ops with a known answer."""
import json
import subprocess
import sys

import pytest
import torch

from mplug_pretrain.utils.host_syncs import HostSyncCounter, host_any
from tests.helpers import REPO_ROOT, demo_vocab


def test_counter_sees_direct_and_hidden_syncs_and_nothing_else():
    x = torch.randn(6)
    mask = x > 0
    with HostSyncCounter() as counter:
        _ = x * 2 + x.sum()  # no sync
        _ = x[torch.tensor([0, 2])]  # integer indexing: no sync
        _ = bool(mask.any())  # one
        _ = x[mask]  # boolean indexing: nonzero inside
        _ = torch.multinomial(torch.ones(2, 3), 1)  # its checks
        assert host_any(torch.tensor([False, True]))  # a host tensor read in place: not a device sync
    assert counter.total == 3, dict(counter.by_op)
    assert counter.by_source == {"ours": 3}


@pytest.mark.slow
def test_at_most_two_host_syncs_per_micro_step(demo_shards):
    code = ("import json; from mplug_pretrain.bench.host_syncs import count_micro_step_syncs; "
            f"print(json.dumps(count_micro_step_syncs(['distributed.precision=bf16', *{demo_vocab(demo_shards)}], "
            "warmup=1, steps=2, stack_depth=3)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ours_per_micro_step"] and max(result["ours_per_micro_step"]) <= 2, result["sites"]
    # the whole micro-step, DeepSpeed's part included: AdamW is fused on the CPU too (torch's per-parameter loop
    # read each parameter's step count back: 184 syncs a micro-step for the tiny preset, 185 in all)
    assert result["per_micro_step"] == result["ours_per_micro_step"], result["by_source"]


def test_tolist_reads_are_counted_when_asked():
    t = torch.arange(3.0)
    with HostSyncCounter(count_tolist=True) as counter:
        assert t.tolist() == [0.0, 1.0, 2.0]
        _ = t + 1
    with HostSyncCounter() as plain:
        t.tolist()
    assert dict(counter.by_op) == {"tolist": 1} and counter.by_source == {"ours": 1}
    assert plain.total == 0
    assert torch.Tensor.tolist(t) == [0.0, 1.0, 2.0]  # the method is restored


@pytest.mark.slow
def test_one_host_sync_per_optimizer_step_outside_log_steps(demo_shards):
    """Whole optimizer steps through the loop (finiteness flag, step, momentum update, log record, checkpoint
    flag): our code reads the device once per step, twice at a log step (the pending records)."""
    code = ("import json; from mplug_pretrain.bench.host_syncs import count_optimizer_step_syncs; "
            f"print(json.dumps(count_optimizer_step_syncs({demo_vocab(demo_shards)}, steps=4, log_every=2)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(result["log_step"]) == [False, False, True, True]  # every other step logs
    assert result["ours_per_step"] == [2 if logged else 1 for logged in result["log_step"]], result["sites"]

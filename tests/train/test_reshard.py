"""Resharding a checkpoint (train/reshard.py) on real DeepSpeed, CPU and gloo: two tiny-preset checkpoints of
2 steps, one written by 2 ranks at ZeRO-2, one by 1 rank (ZeRO-2 on one rank runs as ZeRO-0), are read back
consolidated and checked against independent readers (DeepSpeed's zero_to_fp32 for the weights, the fragments
each rank's file records for the moments); then each is loaded into engines of another world size and stage
by tests/train/reshard_worker.py, which reads the engine back through DeepSpeed's own accessors, saves it
again (read back here: the same state in the new layout) and trains one more step from it."""
import json
import math
import os
import shutil
import subprocess

import pytest
import torch

from mplug_pretrain.models.weights.reader import UnsafeFileError, read_torch_file, weights_only_loads
from mplug_pretrain.train.checkpoint import CheckpointError, deepspeed_safe_globals, tag_for
from mplug_pretrain.train.reshard import MODEL_STATES, load_resharded, optim_states_file, read_consolidated
from tests.helpers import REPO_ROOT, forked_ranks, run_mplug, tiny_pretrain_args

pytestmark = pytest.mark.slow
WORKER = os.path.join(REPO_ROOT, "tests", "train", "reshard_worker.py")
STEPS = 2
TAG = tag_for(STEPS)


@pytest.fixture(scope="module")
def written(module_mktemp, demo_shards):
    """{world size: checkpoints dir} of the same two-step tiny run on 2 ranks (ZeRO-2) and 1 rank (ZeRO-0)."""
    root = module_mktemp("reshard")
    out = {}
    for world in (2, 1):
        name = f"w{world}"
        args = tiny_pretrain_args(root, demo_shards, name, steps=STEPS, extra=[
            "distributed.zero_stage=2", f"run.checkpoint_every_steps={STEPS}", "model.heads.momentum=0.9"])
        proc = run_mplug(["pretrain", "--nproc", str(world), *args])
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[world] = str(root / name / "checkpoints")
    assert any(f.startswith("zero_pp_rank_1") for f in os.listdir(os.path.join(out[2], TAG)))
    assert not any("optim_states" in f for f in os.listdir(os.path.join(out[1], TAG)))  # ran as ZeRO-0
    return out


def assert_equal_tensors(expected: dict, got: dict, what: str) -> None:
    assert expected.keys() == got.keys(), (what, sorted(expected.keys() ^ got.keys())[:5])
    for name, value in expected.items():
        assert got[name].shape == value.shape and torch.equal(got[name].to(value.dtype), value), (what, name)


def test_zero2_two_ranks_read_as_zero_to_fp32_and_the_rank_fragments(written):
    tag_dir = os.path.join(written[2], TAG)
    state = read_consolidated(tag_dir, 2)
    assert (state.zero_stage, state.world_size, state.step) == (2, 2, STEPS)

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with weights_only_loads(deepspeed_safe_globals()):  # zero_to_fp32 passes weights_only=False itself
        reference = get_fp32_state_dict_from_zero_checkpoint(written[2], tag=TAG)
    assert_equal_tensors(reference, {**state.masters, **state.module_state}, "weights")
    assert any("_m." in name for name in state.module_state) and "itc.image_queue" in state.module_state
    assert int(state.module_state["itc.queue_ptr"]) > 0  # the queues hold the two steps' features

    # moments: each rank's file records where each parameter's fragment lies in its flat partition; the
    # fragments of all ranks, in rank order, are the whole parameter
    pieces = {key: {name: [] for name in state.masters} for key in ("exp_avg", "exp_avg_sq")}
    for rank in range(2):
        sd = read_torch_file(os.path.join(tag_dir, optim_states_file(rank)), deepspeed_safe_globals())
        sd = sd["optimizer_state_dict"]
        base = sd["base_optimizer_state"]
        for g, mapping in enumerate(sd["param_slice_mappings"]):
            group_state = base["state"][base["param_groups"][g]["params"][0]]
            assert int(group_state["step"]) == STEPS
            for name, address in mapping.items():
                for key in pieces:
                    pieces[key][name].append(group_state[key][address.start:address.start + address.numel])
    for key, by_name in pieces.items():
        assert_equal_tensors({name: torch.cat(parts) for name, parts in by_name.items()},
                             {name: value.reshape(-1) for name, value in state.moments[key].items()}, key)


def test_zero0_one_rank_read_consolidated(written):
    """ZeRO-0's optimizer indices are named through the model (built on the meta device); the weights are the
    module's. Whether the names are right is checked by the round trip of test_reshard_into_other_engines."""
    tag_dir = os.path.join(written[1], TAG)
    state = read_consolidated(tag_dir, 1)
    assert (state.zero_stage, state.world_size, state.step) == (0, 1, STEPS)
    module = read_torch_file(os.path.join(tag_dir, MODEL_STATES), deepspeed_safe_globals())["module"]
    assert_equal_tensors(module, {**state.masters, **state.module_state}, "module")
    assert state.exp_avg.keys() == state.exp_avg_sq.keys() == state.masters.keys()
    assert all(state.exp_avg[n].shape == p.shape for n, p in state.masters.items())


def launch_worker(nproc: int, stage: int, ckpt_dir: str, saved_world: int, shards: str, out) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)  # this checkout, not an installed copy
    command = forked_ranks(nproc, WORKER, str(stage), ckpt_dir, TAG, str(saved_world), shards, str(out))
    proc = subprocess.run(command, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out / "step.json") as f:
        return json.load(f)


@pytest.mark.parametrize(("source_world", "nproc", "stage"), [
    (2, 1, 3),  # 2 ranks ZeRO-2 -> 1 rank ZeRO-3
    (2, 1, 0),  # 2 ranks ZeRO-2 -> 1 rank ZeRO-0
    (1, 2, 2),  # 1 rank ZeRO-0 -> 2 ranks ZeRO-2
    (1, 2, 3),  # 1 rank ZeRO-0 -> 2 ranks ZeRO-3 (partitions with padding: the 1-element temperature)
])
def test_reshard_into_other_engines(written, demo_shards, tmp_path, source_world, nproc, stage):
    """The engine holds the consolidated state exactly (masters, moments, step, momentum encoders, queues),
    saving it writes the same state in the new layout, and it trains on (AdamW's step goes on from the saved
    one)."""
    expected = read_consolidated(os.path.join(written[source_world], TAG), source_world)
    after = launch_worker(nproc, stage, written[source_world], source_world, demo_shards["pretrain_train"],
                          tmp_path)

    got = torch.load(tmp_path / "engine_state.pt", weights_only=True)
    assert_equal_tensors(expected.masters, got["masters"], "masters")
    assert_equal_tensors(expected.exp_avg, got["exp_avg"], "exp_avg")
    assert_equal_tensors(expected.exp_avg_sq, got["exp_avg_sq"], "exp_avg_sq")
    assert got["steps"] == [STEPS]
    assert any("_m." in name for name in got["frozen"]) and "itc.queue_ptr" in got["buffers"]
    for part, what in (("frozen", "momentum encoders"), ("buffers", "queues")):
        assert_equal_tensors({k: expected.module_state[k] for k in got[part]}, got[part], what)

    resaved = read_consolidated(os.path.join(tmp_path, "resaved", TAG), nproc)
    assert (resaved.zero_stage, resaved.world_size, resaved.step) == (stage, nproc, STEPS)
    for attr in ("masters", "exp_avg", "exp_avg_sq", "module_state"):
        assert_equal_tensors(getattr(expected, attr), getattr(resaved, attr), f"resaved {attr}")

    assert after["steps_after"] == [STEPS + 1]
    assert all(math.isfinite(value) and abs(value) < 1e4 for value in after["losses"].values()), after


def test_missing_or_foreign_partitions_are_named(written, tmp_path):
    tag_dir = tmp_path / TAG
    shutil.copytree(os.path.join(written[2], TAG), tag_dir, copy_function=os.link)
    for world in (1, 3):
        with pytest.raises(CheckpointError, match=f"{optim_states_file(0)}: partitioned over \\[2\\] rank"):
            read_consolidated(str(tag_dir), world)
    os.remove(tag_dir / optim_states_file(1))
    with pytest.raises(CheckpointError, match=f"{optim_states_file(1)}: missing"):
        read_consolidated(str(tag_dir), 2)


def test_load_resharded_scans_the_tag_before_reading(written, tmp_path):
    """A file of the tag that would need arbitrary unpickling is refused before anything is read or
    applied."""
    tag_dir = tmp_path / TAG
    shutil.copytree(os.path.join(written[2], TAG), tag_dir, copy_function=os.link)
    os.remove(tag_dir / optim_states_file(1))
    payload = {"optimizer_state_dict": {}, "note": Exploit(str(tmp_path / "ran"))}
    torch.save(payload, tag_dir / optim_states_file(1))
    with pytest.raises(UnsafeFileError, match=f"{optim_states_file(1)}: refused: .*exec"):
        load_resharded(None, str(tmp_path), TAG, rank=0, zero_stage=3, saved_world_size=2)
    assert not (tmp_path / "ran").exists()


class Exploit:
    """Unpickling it would call ``exec`` (writing a marker file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)

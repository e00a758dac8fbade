"""Issue 37, item 5: when another rank froze or ended, a rank's collective fails with a message a user can act on
(distributed.timeout_minutes named, or "another rank ended"), not a bare gloo error; while saving a checkpoint the
message names the checkpoint and the disk's free space. Real gloo process groups of 2 processes."""
import datetime
import json
import multiprocessing
import os
import time

import pytest

from mplug_pretrain.errors import DataError, PeerRankError
from mplug_pretrain.train.distributed import free_port, naming_peer_failures, peer_failure

TIMEOUT_MINUTES = 0.05  # 3 s


def _rank(rank: int, port: int, behaviour: str, ckpt_dir: str) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(minutes=TIMEOUT_MINUTES))
    if rank == 1:
        if behaviour == "frozen":
            time.sleep(30)
        os._exit(0)  # ends without a word, as a rank killed by a full disk or the OOM killer would
    try:
        with naming_peer_failures(TIMEOUT_MINUTES):
            if behaviour == "saving":
                from mplug_pretrain.train.checkpoint import _barrier_while_saving
                time.sleep(1)
                _barrier_while_saving(ckpt_dir, "step00000007")
            else:
                dist.all_reduce(torch.ones(4))
        outcome = ["no error", ""]
    except Exception as err:  # noqa: BLE001  (the test reports whatever it was)
        outcome = [type(err).__name__, str(err)]
    with open(os.path.join(ckpt_dir, "outcome.json"), "w") as f:
        json.dump(outcome, f)
    os._exit(0)


def _run(behaviour: str, tmp_path) -> tuple[str, str]:
    """Rank 0's outcome (error class, message) when rank 1 behaves as ``behaviour`` says."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, port, behaviour, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[0].join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    with open(tmp_path / "outcome.json") as f:
        return tuple(json.load(f))


def test_a_frozen_rank_is_named_by_the_timeout_setting(tmp_path):
    kind, message = _run("frozen", tmp_path)
    assert kind == "PeerRankError", message
    assert message.startswith("rank 0: no answer from another rank within distributed.timeout_minutes=0.05 (")


def test_a_rank_that_ended_is_named_as_such(tmp_path):
    kind, message = _run("ended", tmp_path)
    assert kind == "PeerRankError", message
    assert message.startswith("rank 0: another rank ended while this one waited for it (")


def test_a_rank_that_ended_while_saving_names_the_checkpoint_and_the_disk(tmp_path):
    kind, message = _run("saving", tmp_path)
    assert kind == "CheckpointError", message
    assert message.startswith(f"{tmp_path}: another rank stopped while checkpoint step00000007 was being written (")
    assert " MiB free there" in message and "--resume latest" in message


def test_other_errors_pass_unchanged():
    assert peer_failure(ValueError("timed out"), 30, 0) is None
    assert peer_failure(DataError("shard.tar: timed out reading"), 30, 0) is None
    assert peer_failure(RuntimeError("CUDA out of memory"), 30, 0) is None
    with pytest.raises(KeyError), naming_peer_failures(30):
        raise KeyError("x")
    with pytest.raises(PeerRankError, match="another rank ended"), naming_peer_failures(30):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40212")

"""`run.report_to: [tensorboard, wandb]` with the real wandb library in offline mode: the local run files it
writes are read back (their record log decoded here, LevelDB-log framing + wandb's own protobuf) and hold the
steps of log.jsonl; TensorBoard keeps working beside it and `run.tensorboard: false` still turns it off."""
from __future__ import annotations

import glob
import json
import os
import struct
import time

import pytest

from tests.helpers import read_log, run_mplug, tiny_pretrain_args

wandb = pytest.importorskip("wandb")
BLOCK = 32768
HEADER = 7  # ":W&B", 0xBEE1 little-endian, version 0


def wandb_records(path: str) -> list:
    """The protobuf Records of a .wandb file: 32 KiB blocks of (crc32, length, type) framed chunks, a record
    split over blocks as FIRST / MIDDLE / LAST chunks (types 2-4; 1 = FULL)."""
    from wandb.proto import wandb_internal_pb2 as pb
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    records, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _next_second() -> None:
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.02)


def history(records) -> dict[int, dict]:
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            out[int(row["_step"])] = row
    return out


@pytest.mark.slow  # one tiny DeepSpeed pretraining process (2 steps) and wandb's own service process
def test_pretraining_reports_to_tensorboard_and_wandb_offline(tmp_path, demo_shards):
    args = tiny_pretrain_args(tmp_path, demo_shards, "wb", steps=2, extra=[
        "run.log_every=1", "run.tensorboard=true", "run.report_to=[tensorboard,wandb]", "run.wandb_project=tests"])
    result = run_mplug(["pretrain", *args], env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "wb"
    [wandb_file] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    run_id = (run_dir / "wandb_id").read_text().strip()
    assert wandb_file.endswith(f"run-{run_id}.wandb")
    records = wandb_records(wandb_file)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run_id and run.project == "tests" and run.display_name == "wb"
    logged = history(records)
    log = read_log(run_dir)
    assert sorted(logged) == [r["step"] for r in log] == [1, 2]
    for row in log:  # every number of log.jsonl, under TensorBoard's panel names (loss_itc -> loss/itc)
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        assert {"loss", "loss_itc", "loss_itm", "loss_mlm", "loss_prefixlm"} <= set(numbers)
        for key, value in numbers.items():
            name = key.replace("lr_", "lr/").replace("loss_", "loss/")
            assert logged[row["step"]][name] == pytest.approx(value), name
    config = {item.key: json.loads(item.value_json) for item in run.config.update}  # the resolved run config
    assert config["optim"]["max_steps"] == 2 and config["model"]["preset"] == "tiny"
    assert config["run"]["report_to"] == ["tensorboard", "wandb"]
    assert glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))


def test_report_to_is_checked_and_tensorboard_false_still_wins():
    from mplug_pretrain.config import load_config
    from mplug_pretrain.errors import ConfigError
    from mplug_pretrain.train.run_log import reporters
    cfg = load_config(None, ["run.report_to=[tensorboard,wandb]", "run.tensorboard=false"], check_paths=False)
    chosen = reporters(cfg)
    assert chosen["tensorboard"] is False and chosen["wandb"].project == "mplug_pretrain"
    assert reporters(load_config(None, check_paths=False)) == {"tensorboard": True, "wandb": None}
    with pytest.raises(ConfigError, match=r"run.report_to\[0\]: expected one of"):
        load_config(None, ["run.report_to=[mlflow]"], check_paths=False)


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    from mplug_pretrain.train.run_log import RunLog, WandbSettings
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = WandbSettings("tests", "resume", config={"a": 1})
    for steps in ([1, 2], [3]):
        if steps[0] > 1:  # wandb names the offline folder by the second a run starts (offline-run-<time>-<id>):
            _next_second()  # a resume in the same second would write the first run's folder and file again
        log = RunLog(str(tmp_path), 3, enabled=True, tensorboard=False, wandb=settings,
                     initial_step=steps[0] - 1)
        for step in steps:
            log.step({"step": step, "loss": 1.0 / step})
        log.close()
    files = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))
    run_id = (tmp_path / "wandb_id").read_text().strip()
    assert files and all(os.path.basename(f) == f"run-{run_id}.wandb" for f in files)
    steps = {}
    for f in files:
        steps.update(history(wandb_records(f)))
    assert sorted(steps) == [1, 2, 3] and steps[3]["loss"] == pytest.approx(1 / 3)

"""A data error raised inside a DataLoader worker ends the run: the main process used to wait for ever at exit on
a worker that ignores SIGTERM (issue 36, item 1). The message names the file the sample count came from."""
import json
import os

import pytest

from tests.data.formats.test_manifest_img2dataset import write_img2dataset_folder
from tests.helpers import REPO_ROOT, run_mplug

pytestmark = pytest.mark.slow


def _lying_stats(folder: str, successes: int) -> str:
    path = os.path.join(folder, "00000_stats.json")
    with open(path) as f:
        stats = json.load(f)
    stats["successes"] = successes
    with open(path, "w") as f:
        json.dump(stats, f)
    return path


@pytest.mark.parametrize("workers", [2, 0])
def test_a_worker_that_raises_ends_the_run_with_the_message(tmp_path, workers):
    folder = str(tmp_path / "i2d")
    write_img2dataset_folder(folder, [20])
    stats = _lying_stats(folder, 10)
    proc = run_mplug(["pretrain", "--config", os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml"),
                      f"data.train_shards={folder}", "data.batch_size=4", f"data.num_workers={workers}",
                      "optim.max_steps=50", f"run.output_dir={tmp_path}", "run.name=lying", "run.tensorboard=false",
                      "model.heads.queue_size=32"], timeout=150)
    assert proc.returncode == 3, proc.stderr[-3000:]
    message = [line for line in proc.stderr.splitlines() if line.startswith("mplug: data error:")]
    assert len(message) == 1, proc.stderr[-3000:]
    assert f"{stats} lists" in message[0] and "manifest.json" not in message[0], message[0]
    assert "Traceback" not in proc.stderr

"""A shipped config run before the demo shards exist says how to make them (issue 36, item 8): `mplug pretrain
--config configs/pretrain_tiny.yaml`, as the README shows it, failed with a bare "path does not exist"."""
import os
import subprocess
import sys

from tests.helpers import REPO_ROOT


def test_pretrain_tiny_without_the_demo_shards_says_to_run_the_demo(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mplug_pretrain", "pretrain", "--config",
                           os.path.join(REPO_ROOT, "configs", "pretrain_tiny.yaml")], check=False, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert proc.returncode == 2
    assert proc.stderr == ("mplug: config error: data.train_shards: path does not exist: "
                           f"data_shards/pretrain/train-000000.tar (relative to {tmp_path}; the demo shards: "
                           "`mplug demo --quick` makes data_shards/ here first, or point the field at your own "
                           "shards)\n")

"""Where `mplug eval` puts its metrics (issue 36, item 8): without --out it printed no path, and a second model
evaluated with the same config overwrote the first's metrics; under torchrun every rank printed the metrics."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.data.reading.test_shard_kind import write_shards
from tests.helpers import REPO_ROOT, call_mplug

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def setup(tmp_path, model_dir):
    shard = write_shards(tmp_path / "shards", "image-text", n=4)
    config = tmp_path / "retrieval.yaml"
    config.write_text(f"run:\n  output_dir: {tmp_path / 'runs'}\n  name: ret\neval:\n  shards: {shard}\n"
                      "  annotations: null\n  image_root: null\n  k_test: 2\n  num_workers: 0\n  batch_size: 4\n")
    models = []
    for name in ("first", "second"):
        shutil.copytree(model_dir, tmp_path / name / "model")
        models.append(tmp_path / name / "model")
    return config, models


def _written(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("[eval] metrics written to ")]
    assert len(lines) == 1, stderr
    return lines[0].removeprefix("[eval] metrics written to ")


def test_each_model_gets_its_own_metrics_file_and_its_path_is_printed(setup):
    config, models = setup
    paths = []
    for model in models:
        proc = call_mplug(["eval", "retrieval", "--config", config, "--checkpoint", model])
        assert proc.returncode == 0, proc.stderr[-3000:]
        paths.append(_written(proc.stderr))
        with open(paths[-1]) as f:
            assert json.load(f)["checkpoint"] == str(model)
    assert paths[0] != paths[1] and all(os.path.isfile(p) for p in paths)


@pytest.mark.slow
def test_torchrun_prints_the_metrics_once(setup, tmp_path):
    config, models = setup
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           "-m", "mplug_pretrain", "eval", "retrieval", "--config", str(config), "--checkpoint",
                           str(models[0]), "--out", str(tmp_path / "m.json")], check=False, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"task": "retrieval"') == 1, proc.stdout
    assert json.loads(proc.stdout[proc.stdout.index("{\n"):])["ranks"] == 2
    assert _written(proc.stderr) == str(tmp_path / "m.json")

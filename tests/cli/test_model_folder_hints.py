"""A path given as ``--checkpoint`` that is not a model folder says what it is and which folder to pass (issue 36,
item 8): a multi-stage caption run folder used to read "no config.json" with no hint to use ``2_scst/model``, and a
path that does not exist read the same."""
import shutil

import pytest

from tests.helpers import REPO_ROOT, call_mplug


@pytest.fixture
def caption_run(tmp_path, model_dir):
    """What `mplug finetune caption` leaves with two stages: RUN/1_xe/model, RUN/2_scst/model."""
    run = tmp_path / "cap"
    for stage in ("1_xe", "2_scst"):
        shutil.copytree(model_dir, run / stage / "model")
        (run / stage / "checkpoints").mkdir()
    return run


def _eval(checkpoint, tmp_path):
    val = tmp_path / "val-000000.tar"
    val.touch()  # it must exist; the model folder is refused before it is read
    return call_mplug(["eval", "caption", "--config", f"{REPO_ROOT}/configs/caption_demo.yaml", "--checkpoint",
                       checkpoint, f"caption.val_shards={val}", "--out", tmp_path / "m.json"])


def _one_line(proc):
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("mplug: "), proc.stderr
    return proc.stderr.strip()


def test_a_multi_stage_run_folder_points_to_the_last_stage(caption_run, tmp_path):
    expected = (f"--checkpoint {caption_run}: a multi-stage run folder, not a model folder; pass its last stage's "
                f"model {caption_run / '2_scst' / 'model'} (earlier: {caption_run / '1_xe' / 'model'})")
    assert _one_line(_eval(caption_run, tmp_path)).endswith(expected)
    assert _one_line(call_mplug(["caption", "--checkpoint", caption_run, tmp_path])).endswith(expected)


def test_a_missing_checkpoint_says_so(tmp_path):
    missing = tmp_path / "no_such_model"
    line = _one_line(_eval(missing, tmp_path))
    assert line.endswith(f"--checkpoint {missing}: not a model folder (no such folder)"), line
    assert "config.json" not in line

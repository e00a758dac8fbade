"""`mplug submit eval` validates exactly what `mplug eval` reads (issue 36, item 6): it used to refuse a config
whose training shards do not exist on the evaluation machine, which `mplug eval` itself accepts."""
import pytest

from tests.helpers import call_mplug


@pytest.fixture
def eval_only_config(tmp_path, model_dir):
    """A caption fine-tuning config as it is on an evaluation machine: the training shards are elsewhere."""
    val = tmp_path / "val-000000.tar"
    val.write_bytes(b"")  # validation checks that it exists; nothing reads it in a dry run
    config = tmp_path / "caption.yaml"
    config.write_text(f"run:\n  output_dir: {tmp_path / 'runs'}\n  name: cap\n"
                      "caption:\n  train_shards: /nowhere/coco-train-{000..099}.tar\n"
                      f"  val_shards: {val}\n")
    return config, model_dir, val


def test_submit_eval_accepts_a_config_whose_training_shards_are_elsewhere(eval_only_config):
    config, model, val = eval_only_config
    proc = call_mplug(["submit", "eval", "caption", "--config", config, "--checkpoint", model,
                       f"caption.val_shards={val}", "--time", "00:30:00", "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    assert f"eval caption --config {config} --checkpoint {model}" in proc.stdout


def test_submit_eval_still_refuses_what_eval_reads(eval_only_config, tmp_path):
    config, model, _ = eval_only_config
    missing = tmp_path / "missing-val.tar"
    argv = ["--config", config, "--checkpoint", model, f"caption.val_shards={missing}"]
    submitted = call_mplug(["submit", "eval", "caption", *argv, "--time", "00:30:00", "--dry-run"])
    evaluated = call_mplug(["eval", "caption", *argv])
    assert submitted.returncode == evaluated.returncode == 2
    assert submitted.stderr == evaluated.stderr == f"mplug: config error: caption.val_shards: path does not exist: {missing}\n"

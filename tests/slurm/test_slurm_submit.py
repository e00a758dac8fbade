"""`mplug submit ... --dry-run`: the printed script, run under bash with srun/scontrol stand-ins and a
recording "python", starts exactly the `mplug` command line a user would type by hand."""

from __future__ import annotations

import os
import shlex
import sys

import pytest

from mplug_pretrain.cli import main


def _dry_run(capsys, argv: list[str]) -> str:
    assert main(["submit", *argv, "--dry-run"]) == 0
    return capsys.readouterr().out


def test_pretrain_runs_the_cli_with_resume_and_verbatim_overrides(
    tmp_path, submit_config, capsys, fake_slurm, argv_recorder
):
    config = submit_config
    # a free-text field (paths such as data.tokenizer are checked before submitting): quoted, never run
    overrides = [f"run.wandb_project=$(touch {tmp_path / 'pwned'})", "optim.lr_rest=5e-5"]
    script = _dry_run(
        capsys,
        [
            "pretrain",
            overrides[0],
            "--nodes",
            "2",
            "--time",
            "00:30:00",
            "--config",
            config,
            "--python",
            argv_recorder.path,
            *overrides[1:],
        ],
    )  # overrides between options
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    result = fake_slurm.run(script, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    [call] = argv_recorder.calls()
    assert call["argv"] == [
        "-m",
        "mplug_pretrain",
        "pretrain",
        "--config",
        config,
        "--resume",
        "auto",
        *overrides,
    ]
    assert not (tmp_path / "pwned").exists()
    assert f"RUN_DIR={tmp_path / 'runs' / 'tiny_run'}" in script.splitlines()
    ranged = _dry_run(capsys, ["pretrain", "--nodes", "1-4", "--time", "00:30:00", "--config", config])
    assert "#SBATCH --nodes=1-4" in ranged.splitlines()


def test_finetune_command(tmp_path, submit_config, capsys, fake_slurm, argv_recorder):
    config = submit_config
    script = _dry_run(
        capsys, ["finetune", "vqa", "--time", "01:00:00", "--config", config, "--python", argv_recorder.path]
    )
    assert fake_slurm.run(script, cwd=str(tmp_path)).returncode == 0
    [call] = argv_recorder.calls()
    assert call["argv"] == [
        "-m",
        "mplug_pretrain",
        "finetune",
        "vqa",
        "--config",
        config,
        "--resume",
        "auto",
    ]


def test_eval_array_covers_every_task_and_checkpoint(
    tmp_path, submit_config, capsys, fake_slurm, argv_recorder, make_model_folder
):
    config = submit_config
    checkpoints = [tmp_path / "step 100", tmp_path / "step_200"]
    for c in checkpoints:
        make_model_folder(c)
    script = _dry_run(
        capsys,
        [
            "eval",
            "caption,vqa",
            "--time",
            "01:00:00",
            "--config",
            config,
            "--python",
            argv_recorder.path,
            "eval.num_frames=4",
            "--checkpoint",
            *map(str, checkpoints),
        ],
    )
    assert "#SBATCH --array=0-3" in script.splitlines()
    run_dir = tmp_path / "runs" / "tiny_run"
    expected = []
    for task in ("caption", "vqa"):
        for checkpoint, label in zip(checkpoints, (f"{tmp_path.name}-step_100", f"{tmp_path.name}-step_200")):
            out = f"{run_dir}/eval/{len(expected)}-{task}-{label}.json"
            expected.append(
                [
                    "-m",
                    "mplug_pretrain",
                    "eval",
                    task,
                    "--config",
                    config,
                    "--checkpoint",
                    str(checkpoint),
                    "--out",
                    out,
                    "eval.num_frames=4",
                ]
            )
    for index in range(4):
        assert fake_slurm.run(script, cwd=str(tmp_path), SLURM_ARRAY_TASK_ID=str(index)).returncode == 0
    assert sorted((c["argv"] for c in argv_recorder.calls()), key=lambda a: a[-2]) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["pretrain", "run.name=$(touch /tmp/pwned)"], "run.name"),  # the config refuses it first
        (["pretrain", "run.name=';touch pw'"], "run.name"),  # a plain name for the config, not for #SBATCH
        (["pretrain", "--time", "2 days"], "--time"),
        (["pretrain", "--signal-seconds", "7200"], "--signal-seconds"),
        (["pretrain", "--partition", "gpu;reboot"], "--partition"),
    ],
)
def test_bad_values_fail_before_submission(submit_config, capsys, argv, message):
    kind, *rest = argv
    options = ["--config", submit_config, *rest]
    if "--time" not in rest:
        options += ["--time", "01:00:00"]
    assert main(["submit", kind, *options, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and "#!/bin/bash" not in err


def test_eval_checkpoint_errors(tmp_path, submit_config, capsys, make_model_folder):
    config = submit_config
    base = ["submit", "eval", "caption", "--time", "01:00:00", "--config", config, "--dry-run"]
    assert main([*base, "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    make_model_folder(tmp_path / "ckpt")
    assert main([*base, "--checkpoint", str(tmp_path / "ckpt"), "eval.no_such_field=4"]) == 2
    err = capsys.readouterr().err  # an override after --checkpoint is read as one, and checked as one
    assert "eval.no_such_field" in err and "does not exist" not in err
    assert main([*base, "--checkpoint", "eval.num_frames=4"]) == 2
    assert "no model folder given" in capsys.readouterr().err
    assert main([*base, "--checkpoint", str(tmp_path / "ckpt"), "--array", "0-1"]) == 2
    assert "beyond the 1 evaluations" in capsys.readouterr().err
    assert (
        main(
            [
                "submit",
                "eval",
                "captioning",
                "--time",
                "01:00:00",
                "--config",
                config,
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--dry-run",
            ]
        )
        == 2
    )
    assert "tasks:" in capsys.readouterr().err


def test_overrides_after_checkpoint_reach_every_command(tmp_path, submit_config, capsys, make_model_folder):
    """`--checkpoint A B eval.x=y` (issue 20): the override is passed on, not taken for a third folder."""
    a, b = tmp_path / "a", tmp_path / "b"
    make_model_folder(a), make_model_folder(b)
    script = _dry_run(capsys, ["eval", "caption", "--time", "01:00:00", "--config", submit_config,
                               "--checkpoint", str(a), str(b), "eval.num_frames=4", "eval.batch_size=3"])
    commands = [line for line in script.splitlines() if " eval caption " in line]
    assert len(commands) == 2, script
    for command, folder in zip(commands, (a, b)):
        assert f"--checkpoint {folder} " in command
        assert command.rstrip().endswith(" eval.num_frames=4 eval.batch_size=3) ;;"), command


def test_array_outputs_are_named_after_the_run_and_step(tmp_path, submit_config, capsys, make_model_folder):
    """Two runs' final ``model/`` folders used to give ``0-caption-model.json`` and ``1-caption-model.json``."""
    from mplug_pretrain.slurm.submit import checkpoint_label
    folders = []
    for run, step in (("run_a", 20), ("run_b", 40)):
        run_dir = tmp_path / "runs" / run
        (run_dir / "checkpoints" / f"step{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / "latest").write_text(f"step{step}")
        (run_dir / "config.yaml").write_text("run:\n  name: x\n")
        make_model_folder(run_dir / "model")
        folders.append(run_dir / "model")
    assert [checkpoint_label(str(f)) for f in folders] == ["run_a-step20", "run_b-step40"]
    exported = tmp_path / "exports" / "best"
    exported.mkdir(parents=True)
    assert checkpoint_label(str(exported)) == "exports-best"
    script = _dry_run(capsys, ["eval", "caption", "--time", "01:00:00", "--config", submit_config,
                               "--checkpoint", *map(str, folders)])
    assert "/eval/0-caption-run_a-step20.json" in script and "/eval/1-caption-run_b-step40.json" in script


def test_setup_lines_run_before_the_tasks_which_take_python_from_their_path(
    tmp_path, submit_config, capsys, fake_slurm, argv_recorder
):
    """--setup (module load, venv activation) instead of the submitting machine's absolute python."""
    venv_bin = tmp_path / "cluster venv" / "bin"
    venv_bin.mkdir(parents=True)
    os.symlink(argv_recorder.path, venv_bin / "python")
    activate = venv_bin / "activate"
    activate.write_text(f'export PATH={shlex.quote(str(venv_bin))}:"$PATH"\nexport MPLUG_SETUP_RAN=$UNSET_BY_SETUP\n')
    script = _dry_run(capsys, ["pretrain", "--time", "01:00:00", "--config", submit_config,
                               "--setup", "module() { echo \"module $*\" >&2; }; module load cuda/12.4",
                               "--setup", f"source {shlex.quote(str(activate))}"])
    assert sys.executable not in script  # nothing of this machine's venv is named
    result = fake_slurm.run(script, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "module load cuda/12.4" in result.stderr  # the setup ran, in order, without set -u stopping it
    [call] = argv_recorder.calls()
    assert call["argv"] == ["-m", "mplug_pretrain", "pretrain", "--config", submit_config, "--resume", "auto"]

    failing = _dry_run(capsys, ["pretrain", "--time", "01:00:00", "--config", submit_config,
                                "--setup", "false", "--python", argv_recorder.path])
    assert fake_slurm.run(failing, cwd=str(tmp_path)).returncode != 0  # a failed setup stops the job
    assert len(argv_recorder.calls()) == 1


def test_no_setup_keeps_this_machines_python(submit_config, capsys):
    script = _dry_run(capsys, ["pretrain", "--time", "01:00:00", "--config", submit_config])
    assert f"CMD=({shlex.quote(os.path.abspath(sys.executable))} -m mplug_pretrain pretrain" in script


def test_mem_cpus_and_passed_through_sbatch_options(submit_config, capsys, caplog):
    script = _dry_run(capsys, ["pretrain", "--time", "01:00:00", "--config", submit_config, "--mem", "64G",
                               "--sbatch-arg=--qos=high", "--sbatch-arg=--exclusive",
                               "--sbatch-arg=--constraint=a100"])
    lines = script.splitlines()
    # the config's loader: data.num_workers = 2 (the default) -> 2 workers + 2
    assert {"#SBATCH --mem=64G", "#SBATCH --cpus-per-task=4", "#SBATCH --qos=high", "#SBATCH --exclusive",
            "#SBATCH --constraint=a100"} <= set(lines)
    assert "export SRUN_CPUS_PER_TASK=4" in script
    assert not caplog.records
    with caplog.at_level("WARNING"):
        low = _dry_run(capsys, ["pretrain", "--time", "01:00:00", "--config", submit_config,
                                "--cpus-per-task", "1", "data.num_workers=6"])
    assert "#SBATCH --cpus-per-task=1" in low.splitlines()
    assert "below the 6 loader worker(s) + 2" in caplog.text and "--cpus-per-task 8" in caplog.text


@pytest.mark.parametrize(
    "option, message",
    [
        (["--mem", "lots"], "--mem"),
        (["--nodes", "4-2"], "--nodes: expected 1 <= MIN <= MAX"),
        (["--sbatch-arg=--nodes=3"], "--nodes is set by mplug submit"),
        (["--sbatch-arg=--output=/x"], "--output is set by mplug submit"),
        (["--sbatch-arg=qos=high"], "expected --name"),
        (["--sbatch-arg=--comment=a b"], "cannot go into an #SBATCH line"),
        (["--sbatch-arg=--qos=high\n#SBATCH --uid=0"], "--sbatch-arg"),
        (["--setup", "a\nb"], "one line per --setup"),
    ],
)
def test_bad_job_options_are_refused(submit_config, capsys, option, message):
    assert main(["submit", "pretrain", "--time", "01:00:00", "--config", submit_config, *option, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and "#!/bin/bash" not in err


def test_eval_refuses_a_task_the_config_or_a_checkpoint_cannot_serve(tmp_path, capsys, make_model_folder):
    """`submit eval retrieval,caption` with a retrieval-only config used to submit an array whose caption tasks
    failed on the cluster; now every (task, checkpoint) is checked first and nothing is submitted."""
    shard = tmp_path / "val-000000.tar"
    shard.touch()
    (tmp_path / "test.json").write_text("[]")
    config = tmp_path / "retrieval.yaml"  # as configs/retrieval_coco.yaml: the Karpathy test json + images
    config.write_text(f"eval:\n  annotations: {tmp_path / 'test.json'}\n  image_root: {tmp_path}\n"
                      f"run:\n  name: r\n  output_dir: {tmp_path / 'runs'}\n")
    model = make_model_folder(tmp_path / "model")
    base = ["submit", "eval", "--time", "01:00:00", "--config", str(config), "--dry-run"]
    assert main([*base, "retrieval", "--checkpoint", model]) == 0
    capsys.readouterr()
    assert main([*base, "retrieval,caption", "--checkpoint", model]) == 2
    captured = capsys.readouterr()
    assert "caption: eval.shards / caption.val_shards" in captured.err and "#!/bin/bash" not in captured.out
    assert not (tmp_path / "runs").exists()
    # a folder without weights, and a classification task asked of a model with no classifier
    (tmp_path / "empty").mkdir()
    assert main([*base, "retrieval", "--checkpoint", str(tmp_path / "empty")]) == 2
    assert "not a model folder (no config.json)" in capsys.readouterr().err
    assert main([*base, "retrieval", "--checkpoint", model, "eval.image_root=null"]) == 2
    assert "eval.image_root: needed with eval.annotations" in capsys.readouterr().err
    assert main([*base, "snli-ve", "--checkpoint", model, f"snli_ve.val_shards={shard}"]) == 2
    assert "no snli-ve classifier (3 classes)" in capsys.readouterr().err
    classifier = make_model_folder(tmp_path / "snli", classifier_classes=3)
    assert main([*base, "snli-ve", "--checkpoint", classifier, f"snli_ve.val_shards={shard}"]) == 0


def test_every_eval_task_has_its_inputs_checked():
    from mplug_pretrain.cli.registry import EVAL_TASKS
    from mplug_pretrain.tasks.eval_inputs import CONFIG_CHECKS
    assert set(CONFIG_CHECKS) == set(EVAL_TASKS)

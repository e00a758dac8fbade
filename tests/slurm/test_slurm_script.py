"""The rendered sbatch script under real bash (srun/scontrol stand-ins, no cluster): user values reach
the program verbatim, the requeue decision, and what may enter #SBATCH lines."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from mplug_pretrain.errors import ConfigError
from mplug_pretrain.slurm.script import SlurmJob, array_indices, render_script, time_limit_seconds

PRINT_ARGV = "import json, sys; print('ARGV ' + json.dumps(sys.argv[1:]))"


def _job(tmp_path, commands, kind: str = "pretrain", **changes) -> SlurmJob:
    job = SlurmJob(
        kind=kind,
        job_name="test",
        nodes=2,
        gpus_per_node=0,
        time="01:00:00",
        workdir=str(tmp_path),
        run_dir=str(tmp_path),
        commands=tuple(tuple(c) for c in commands),
    )
    return replace(job, **changes)


def _printed_argv(result: subprocess.CompletedProcess) -> list[str]:
    lines = [line for line in result.stdout.splitlines() if line.startswith("ARGV ")]
    assert len(lines) == 1, result.stdout + result.stderr
    return json.loads(lines[0][len("ARGV ") :])


def _hostile_values(tmp_path) -> list[str]:
    pwned, victim = tmp_path / "pwned", tmp_path / "victim"
    return [
        f"run.name=$(touch {pwned})",
        f"data.tokenizer=`touch {pwned}`",
        f"'; touch {pwned}; '",
        f'"; touch {pwned}; "',
        f"; rm -rf {victim}",
        "'; rm -rf /'",
        "a b  c",
        "$HOME",
        "*",
        "~",
        "line1\nline2",
        "",
        "back\\slash",
        "!!",
        "${IFS}",
        "x=1;y=2",
        "%j %A",
    ]


def test_user_values_reach_the_program_verbatim(tmp_path, fake_slurm):
    (tmp_path / "victim").mkdir()
    values = _hostile_values(tmp_path)
    script = render_script(_job(tmp_path, [(sys.executable, "-c", PRINT_ARGV, *values)]))
    assert subprocess.run(["bash", "-n"], check=False, input=script, text=True).returncode == 0
    result = fake_slurm.run(script, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert _printed_argv(result) == values
    assert not (tmp_path / "pwned").exists() and (tmp_path / "victim").is_dir()


@pytest.mark.parametrize("gpus_per_node", [0, 4])
def test_srun_starts_the_task_count_of_this_start(tmp_path, fake_slurm, gpus_per_node):
    """A job on --nodes 1-3 requeued onto 3 nodes keeps SLURM_NTASKS of its first start (here 2): srun must start
    3 nodes x tasks per node, from SLURM_JOB_NUM_NODES."""
    script = render_script(_job(tmp_path, [(sys.executable, "-c", PRINT_ARGV)], nodes="1-3",
                                gpus_per_node=gpus_per_node))
    result = fake_slurm.run(script, cwd=str(tmp_path), SLURM_JOB_NUM_NODES="3", SLURM_NTASKS="2",
                            SLURM_RESTART_COUNT="1")
    assert result.returncode == 0, result.stderr
    per_node = max(gpus_per_node, 1)
    expected = f"--kill-on-bad-exit=1 --nodes=3 --ntasks={3 * per_node} --ntasks-per-node={per_node}"
    assert fake_slurm.srun_options() == [expected]
    assert f"{3 * per_node} tasks" in result.stdout


def test_eval_array_picks_the_command_of_its_index(tmp_path, fake_slurm):
    values = _hostile_values(tmp_path)
    commands = [
        (sys.executable, "-c", PRINT_ARGV, str(index), value) for index, value in enumerate(values[:3])
    ]
    script = render_script(_job(tmp_path, commands, kind="eval", nodes=1))
    for index, value in enumerate(values[:3]):
        result = fake_slurm.run(script, cwd=str(tmp_path), SLURM_ARRAY_TASK_ID=str(index))
        assert result.returncode == 0, result.stderr
        assert _printed_argv(result) == [str(index), value]
    beyond = fake_slurm.run(script, cwd=str(tmp_path), SLURM_ARRAY_TASK_ID="7")
    assert beyond.returncode != 0 and "no evaluation for array index 7" in beyond.stderr
    assert not (tmp_path / "pwned").exists()


def test_requeues_only_after_the_trainer_wrote_the_marker(tmp_path, fake_slurm):
    marker = tmp_path / "preempted"
    write_marker = f"open({str(marker)!r}, 'w').write('USR1')"
    saved = fake_slurm.run(
        render_script(_job(tmp_path, [(sys.executable, "-c", write_marker)])), cwd=str(tmp_path)
    )
    assert saved.returncode == 0 and fake_slurm.requeues() == ["requeue 123"], saved.stderr
    assert not marker.exists()  # removed before the requeue, so the next run does not requeue again

    marker.write_text("stale")  # from an earlier run: cleared at start, no requeue after a clean finish
    finished = fake_slurm.run(
        render_script(_job(tmp_path, [(sys.executable, "-c", "pass")])), cwd=str(tmp_path)
    )
    assert finished.returncode == 0 and fake_slurm.requeues() == ["requeue 123"] and not marker.exists()

    failed = fake_slurm.run(
        render_script(_job(tmp_path, [(sys.executable, "-c", "raise SystemExit(7)")])), cwd=str(tmp_path)
    )
    assert failed.returncode == 7 and fake_slurm.requeues() == ["requeue 123"]


@pytest.mark.parametrize(
    "change",
    [
        {"job_name": "x\n#SBATCH --uid=0"},
        {"job_name": "a b"},
        {"partition": "gpu --exclusive"},
        {"account": "a'b"},
        {"workdir": "/tmp/with space"},
        {"run_dir": "/tmp/x%j"},
        {"workdir": "relative/dir"},
    ],
)
def test_values_for_sbatch_lines_are_restricted(tmp_path, change):
    with pytest.raises(ConfigError):
        render_script(_job(tmp_path, [("python",)], **change))


def test_layout_one_task_per_gpu_or_one_cpu_task_per_node(tmp_path):
    gpu = render_script(_job(tmp_path, [("python",)], nodes=4, gpus_per_node=8, cpus_per_task=10))
    assert {
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=10",
    } <= set(gpu.splitlines())
    assert "export SRUN_CPUS_PER_TASK=10" in gpu
    cpu = render_script(_job(tmp_path, [("python",)], nodes=2, gpus_per_node=0)).splitlines()
    assert "#SBATCH --ntasks-per-node=1" in cpu and not any("--gpus" in line for line in cpu)


@pytest.mark.parametrize(
    "text, seconds",
    [("00:10:00", 10 * 60), ("48:00:00", 48 * 3600), ("1-02:03:04", 86400 + 2 * 3600 + 3 * 60 + 4)],
)
def test_time_limit_seconds(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("text", ["10", "1:2:3", "10:61:00", "1-2", "01:00:00 ; x"])
def test_time_limit_rejects(text):
    with pytest.raises(ConfigError, match="--time"):
        time_limit_seconds(text)


def test_array_indices():
    assert array_indices("0-6:3,8%2") == [0, 3, 6, 8]
    assert array_indices("4") == [4]
    for bad in ("3-1", "a", "0-3%x", "0-3:0", ""):
        with pytest.raises(ConfigError, match="--array"):
            array_indices(bad)


def test_job_options_are_checked(tmp_path):
    two = [("python", "a"), ("python", "b")]
    with pytest.raises(ConfigError, match="beyond the 2 evaluations"):
        render_script(_job(tmp_path, two, kind="eval", array="0-2"))
    assert "#SBATCH --array=1%1" in render_script(_job(tmp_path, two, kind="eval", array="1%1")).splitlines()
    with pytest.raises(ConfigError, match="--array: only for eval"):
        render_script(_job(tmp_path, [("python",)], array="0"))
    with pytest.raises(ConfigError, match="--signal-seconds"):
        render_script(_job(tmp_path, [("python",)], time="00:05:00", signal_seconds=300))
    for bad in (0, "0-2", "3-2", "2-", "a", "1-2-3", "2 ; x"):
        with pytest.raises(ConfigError, match="--nodes"):
            render_script(_job(tmp_path, [("python",)], nodes=bad))


def test_a_node_range_goes_to_sbatch_and_the_header_says_what_a_requeue_does(tmp_path):
    script = render_script(_job(tmp_path, [("python",)], nodes="2-8", gpus_per_node=8))
    assert "#SBATCH --nodes=2-8" in script.splitlines()
    assert "2-8 (as many as Slurm gives; a requeue may get another count and the run resumes on it)" in script
    assert "#SBATCH --nodes=3" in render_script(_job(tmp_path, [("python",)], nodes="3")).splitlines()


def test_setup_lines_and_passed_through_options_render(tmp_path):
    script = render_script(_job(tmp_path, [("python", "-m", "mplug_pretrain")], mem="0",
                                setup=("module load cuda/12.4", "source /opt/venv/bin/activate"),
                                sbatch_args=("--qos=high", "--exclusive")))
    lines = script.splitlines()
    assert {"#SBATCH --mem=0", "#SBATCH --qos=high", "#SBATCH --exclusive"} <= set(lines)
    setup = lines.index("module load cuda/12.4")
    assert lines[setup - 1] == "set +u" and lines[setup + 1] == "source /opt/venv/bin/activate"
    assert lines[setup + 2] == "set -u" and setup < lines.index("CMD=(python -m mplug_pretrain)")
    assert subprocess.run(["bash", "-n"], check=False, input=script, text=True).returncode == 0


@pytest.mark.parametrize("visible, local_ranks, devices", [(8, range(8), list(range(8))),
                                                           (1, range(4), [0, 0, 0, 0]),
                                                           (2, range(4), [0, 1, 0, 1])])
def test_local_device_wraps_around_the_visible_gpus(visible, local_ranks, devices):
    """One GPU bound per task: SLURM_LOCALID 3 sees one device, which is device 0 for it."""
    from mplug_pretrain.train.distributed import local_device
    assert [local_device(r, visible) for r in local_ranks] == devices


PRINT_PORT = "import os; print('PORT ' + os.environ['MASTER_PORT'])"


def test_master_port_moves_off_a_port_another_program_listens_on(tmp_path, fake_slurm):
    """MASTER_PORT = 20000 + job id % 20000, unless a program already listens there on the first node (where the
    batch shell runs): then one the kernel picks (a taken port failed a two-node job with EADDRINUSE)."""
    import socket
    script = render_script(_job(tmp_path, [(sys.executable, "-c", PRINT_PORT)]))

    def port(job_id: int) -> int:
        result = fake_slurm.run(script, cwd=str(tmp_path), SLURM_JOB_ID=str(job_id))
        assert result.returncode == 0, result.stderr
        return int(next(line for line in result.stdout.splitlines() if line.startswith("PORT "))[5:])

    listener = socket.socket()
    try:
        taken = next(p for p in range(20100, 39999, 97) if _bind(listener, p))
        listener.listen()
        moved = port(taken - 20000)
        assert moved != taken and 0 < moved < 65536
    finally:
        listener.close()
    assert port(taken - 20000) == taken  # free again: the derived port


def _bind(sock, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def test_launcher_variables_of_the_submitting_shell_do_not_reach_the_tasks(tmp_path, fake_slurm):
    """sbatch exports the submitter's environment: a RANK=0 / WORLD_SIZE=1 left there (a shell inside torchrun, or a
    process that initialised torch.distributed) made both tasks of a two-node job rank 0 of a world of one, the
    second failing with EADDRINUSE on MASTER_PORT. The tasks must see only Slurm's own variables."""
    probe = "import json, os; print('ENV ' + json.dumps([os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')]))"
    script = render_script(_job(tmp_path, [(sys.executable, "-c", probe)]))
    result = fake_slurm.run(script, cwd=str(tmp_path), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("ENV "))
    assert json.loads(line[4:]) == [None, None, None]

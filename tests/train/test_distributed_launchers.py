"""train/distributed.py: the environment of each launcher -> (rank, world size, local rank, launcher), and a
real `accelerate launch` of two CPU processes that initialise through our init and all-reduce over gloo."""
import json
import os
import subprocess
import sys

import pytest

from mplug_pretrain.train.distributed import WorldInfo, world_info_from_env
from tests.helpers import REPO_ROOT

# what each launcher exports for the process with global rank 5 (local rank 1) of 8 on 4 nodes x 2
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[0-3]"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPICH = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1"}


@pytest.mark.parametrize("env, launcher", [
    (TORCHRUN, "torchrun"),
    ({**TORCHRUN, "CROSS_RANK": "2", "CROSS_SIZE": "4"}, "deepspeed"),
    ({**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO"}, "accelerate"),
    (SLURM, "srun"),
    (OPENMPI, "mpi"),
    (MPICH, "mpi"),
    ({**OPENMPI, "ACCELERATE_USE_CPU": "True"}, "accelerate"),  # `accelerate launch --cpu` runs mpirun
])
def test_each_launcher_gives_rank_5_of_8(env, launcher):
    assert world_info_from_env(env) == WorldInfo(rank=5, world_size=8, local_rank=1, launcher=launcher)


def test_mpirun_inside_an_sbatch_allocation_reads_mpi_not_slurm():
    # sbatch --ntasks 8 then mpirun: every process inherits SLURM_NTASKS=8 and SLURM_PROCID=0
    env = {**OPENMPI, "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"}
    assert world_info_from_env(env) == WorldInfo(5, 8, 1, "mpi")


def test_single_process_cases():
    assert world_info_from_env({}) == WorldInfo(0, 1, 0, "single")
    # one srun task, or `accelerate launch --cpu` with one process: nothing distributed
    assert world_info_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == WorldInfo(0, 1, 0, "single")
    assert world_info_from_env({"ACCELERATE_USE_CPU": "True"}) == WorldInfo(0, 1, 0, "single")
    # the local rank defaults to 0 where a launcher does not export it
    assert world_info_from_env({"PMI_RANK": "3", "PMI_SIZE": "4"}) == WorldInfo(3, 4, 0, "mpi")


SCRIPT = """
import json
import sys
import torch
import torch.distributed as dist
from mplug_pretrain.train.distributed import init_distributed, shutdown_distributed
info = init_distributed(backend="auto", timeout_minutes=2)
value = torch.tensor([float(10 ** info.rank)])
dist.all_reduce(value)
# one file per rank: two ranks printing to one pipe can interleave their lines
with open(f"{sys.argv[1]}/rank{info.rank}.json", "w") as f:
    json.dump({"rank": info.rank, "world": info.world_size, "local": info.local_rank,
               "launcher": info.launcher, "sum": value.item(), "backend": dist.get_backend()}, f)
shutdown_distributed()
"""
# torchvision wheels here are CUDA builds and accelerate's CLI imports torchvision: install our shim first
# (mplug_pretrain/compat.py), then run accelerate's own `accelerate` entry point unchanged
ACCELERATE = ("import sys; from mplug_pretrain.compat import ensure_torchvision_importable; "
              "ensure_torchvision_importable(); from accelerate.commands.accelerate_cli import main; "
              "sys.argv = ['accelerate', *sys.argv[1:]]; main()")


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes_all_reduce(tmp_path):
    pytest.importorskip("accelerate")
    script = tmp_path / "all_reduce.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(tmp_path / "hf")}
    # on CPU, accelerate starts several processes through torch.distributed.run with --multi_gpu
    # (its --cpu mode starts one, or several only through an mpirun hostfile)
    proc = subprocess.run([sys.executable, "-c", ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           "--main_process_port", "0", str(script), str(tmp_path)],
                          check=False, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in results] == [0, 1] and [r["local"] for r in results] == [0, 1]
    for r in results:
        assert r["world"] == 2 and r["launcher"] == "accelerate" and r["backend"] == "gloo"
        assert r["sum"] == 1 + 10  # 10**0 + 10**1: both ranks took part

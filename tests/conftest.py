"""Shared test setup: offline, CPU, DeepSpeed's JIT builds cached inside the project."""
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO_ROOT, ".cache", "torch_extensions"))
# One OpenMP thread per process, waiting passively, here and in every process a test starts: the suite must
# pass beside other work, and two spinning threads per process on a busy 2-core machine ran 17-25x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import pytest


@pytest.fixture(scope="session")
def demo_shards():
    """The embedded demo shards (made on first use, shared by every test that needs real shards)."""
    from mplug_pretrain.demo.shards import ensure_demo_shards
    paths = ensure_demo_shards(os.path.join(REPO_ROOT, "data_shards"))
    return {k: v if os.path.isabs(v) else os.path.join(REPO_ROOT, v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def one_thread():
    """Results do not depend on it; on a shared 2-core machine one thread avoids OpenMP spin contention.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""Shared test setup: offline, CPU, DeepSpeed's JIT builds cached inside the project."""
import os
import shutil

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
def module_mktemp(tmp_path_factory, request):
    """``mktemp(name)`` for one module's shared fixtures. What it made is removed once the module's tests are done,
    unless one of them failed: kept for the whole session, the module-wide runs' checkpoints filled a CI disk
    (a run of the suite wrote 22-26 GB). Per-test folders go as each test passes (tmp_path_retention_policy)."""
    made = []
    failed_before = request.session.testsfailed

    def mktemp(name: str):
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed_before:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def one_thread():
    """Results do not depend on it; on a shared 2-core machine one thread avoids OpenMP spin contention.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    """bert-base-uncased's WordPiece vocabulary (shipped with the package)."""
    from mplug_pretrain.data.tokenizer import load_tokenizer
    return load_tokenizer()


def make_text_batch(batch: int, max_len: int, seed: int = 0, min_len: int = 4, vocab: tuple = (1000, 30000)):
    """[CLS] random word ids [SEP] [PAD]...: ids and mask [batch, max_len], lengths in [min_len, max_len]."""
    import torch

    from mplug_pretrain.models.decoders.api import BOS_ID, EOS_ID, PAD_ID
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
    lengths[0] = max_len
    ids = torch.randint(vocab[0], vocab[1], (batch, max_len), generator=g)
    mask = (torch.arange(max_len)[None] < lengths[:, None]).long()
    ids[:, 0] = BOS_ID
    ids[torch.arange(batch), lengths - 1] = EOS_ID
    return ids.masked_fill(mask == 0, PAD_ID), mask


@pytest.fixture
def text_batch():
    """Small text batches in the tokenizer's layout (``make_text_batch``)."""
    return make_text_batch


@pytest.fixture(scope="session")
def tiny_model():
    """One tiny MPLUG with seeded random weights, shared by the tests that only read it."""
    import torch

    import mplug_pretrain  # noqa: F401  (torchvision shim before timm / open_clip)
    from mplug_pretrain.models.presets import build_model
    torch.manual_seed(0)
    return build_model("tiny")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model folder with seeded random weights (save_pretrained)."""
    import torch

    import mplug_pretrain  # noqa: F401  (torchvision shim first)
    from mplug_pretrain.models.presets import build_model
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    build_model("tiny").save_pretrained(path)
    return path


def _module_of(nodeid: str) -> str:
    """The unit a pytest-xdist worker takes whole: a test module, or all tests of the local Slurm cluster (one
    session fixture, one set of ports)."""
    path = nodeid.split("::")[0]
    return "tests/slurm" if path.startswith("tests/slurm/") else path


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent when xdist is not loaded
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs two workers; each takes whole modules, so a module's shared fixture (a fine-tuning run,
    the demo) is made once, not once per worker. (``--dist loadgroup`` would do it with markers, but xdist 3.8
    groups by rewriting ``item._nodeid``, which pytest 9 no longer reads: every module was split in two.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _module_of(nodeid)

    config.option.loadscopereorder = False  # keep our order (slow modules first), not the largest modules first
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Modules with slow end-to-end tests first, so that two workers finish together rather than one of them
    starting the demo last (stable otherwise: the order within a module is kept)."""
    slow = {_module_of(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _module_of(item.nodeid) not in slow)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves os.environ as it found it: an in-process training (init_distributed exports RANK,
    WORLD_SIZE, MASTER_PORT for torch and DeepSpeed) must not turn a later test's `mplug pretrain --nproc 2` into
    one rank of that world (a whole suite once failed 12 tests so)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)

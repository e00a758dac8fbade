"""``ShardLoader``: the object the trainer iterates. A torch ``DataLoader`` (batch_size=None: the
stream batches itself) over a ``ShardStream``, plus epoch/resume position and decode counts.

    loader.num_batches   batches per rank of the current epoch (the same on every rank; a re-split epoch counts
                         those its earlier layout yielded, LoaderSpec.resplit_from)
    len(loader)          batches this iteration yields (num_batches - start_batch)
    loader.set_epoch(e, start_batch=0)  the next pass (its persistent workers read the new position)
    loader.stats         DecodeStats summed over all workers and iterations; loader.log_line()
    loader.image_normalize  None (float images), or the ``DeviceNormalize`` the consumer applies to the batches'
                         uint8 ``image`` on its device (train/loop.py does)
"""
from __future__ import annotations

import logging
import signal
import weakref
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from mplug_pretrain.data.reading.decode_stats import DecodeStats
from mplug_pretrain.data.reading.epoch_plan import derive_seed
from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.utils.parent_death import die_with_parent

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def leave_stop_signals_to_main(worker_id: int | None = None) -> None:
    """DataLoader ``worker_init_fn``: a worker ignores SIGTERM / SIGUSR1 / SIGINT. ``scancel``, Slurm's time
    limit and systemd signal the whole process group; a worker that died of it made the main process raise
    ("DataLoader worker ... killed by signal: Terminated") before it could checkpoint. The main process
    (train/signals.py) saves at the next step and exits; the workers end with it (and at once, by SIGKILL,
    should it be killed: they ignore the gentler signals)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)


def worker_message(err: Exception) -> str:
    """The message a worker raised, without the "Caught DataError in DataLoader worker process 0. Original
    Traceback ..." text torch wraps it in (its last line is "module.DataError: message")."""
    text = str(err)
    if not text.startswith("Caught ") or "DataLoader worker" not in text.split("\n", 1)[0]:
        return text
    last = text.rstrip().rsplit("\n", 1)[-1]
    return last.removeprefix(f"{type(err).__module__}.{type(err).__qualname__}: ")


def stop_workers(dataloader: DataLoader) -> None:
    """End a DataLoader's persistent workers now. Needed at interpreter exit: multiprocessing then SIGTERMs its
    daemon children and waits for them, and our workers ignore SIGTERM (``leave_stop_signals_to_main``)."""
    iterator = getattr(dataloader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


class ShardLoader:
    def __init__(self, stream, answer_list: list[str] | None = None, image_normalize=None):
        self.stream = stream  # a ShardStream: its ``spec`` (data/reading/loader_spec.py) says how many workers
        self.answer_list = answer_list
        self.image_normalize = image_normalize
        self._dataloader: DataLoader | None = None  # made at the first pass, its workers kept for the next ones
        self.stats = DecodeStats()
        self.set_epoch(stream.epoch, stream.start_batch)

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    @property
    def num_batches(self) -> int:
        return self.stream.num_batches(self.epoch)

    @property
    def start_batch(self) -> int:
        return self.stream.start_batch

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        first, last = self.stream.first_batch(epoch), self.stream.num_batches(epoch)
        if epoch < 0 or not first <= start_batch <= last:
            raise ConfigError(f"data position: epoch {epoch}, start_batch {start_batch} outside "
                              f"{first}..{last} batches per epoch")
        self.stream.move_to(epoch, start_batch)

    def __len__(self) -> int:
        return self.num_batches - self.stream.start_batch

    def __iter__(self) -> Iterator[dict]:
        # A DataLoader iterator draws its workers' base seed when it starts (here: at the first batch,
        # this being a generator), from the global torch RNG unless given a generator of its own. That
        # draw happened before step 1 in an uninterrupted run but after the RNG restore in a resumed one,
        # so dropout / MLM masking diverged after resume. Our data is seeded explicitly (epoch_plan), so
        # the base seed gets a private generator and the training RNG stream is never touched.
        if self._dataloader is None:
            base_seed = torch.Generator().manual_seed(derive_seed(self.stream.spec.seed, "dataloader"))
            spec = self.stream.spec
            # persistent: the workers (and their imports, tokenizer, transforms) outlive a pass; each new pass
            # (the next epoch, set_epoch) starts their streams again from the shared position (ShardStream)
            self._dataloader = DataLoader(self.stream, batch_size=None, num_workers=spec.num_workers,
                                          pin_memory=spec.pin_memory, persistent_workers=spec.num_workers > 0,
                                          generator=base_seed, worker_init_fn=leave_stop_signals_to_main)
            weakref.finalize(self, stop_workers, self._dataloader)  # when this loader goes, or at exit
        try:
            for batch in self._dataloader:
                self.stats.merge(batch.pop("__stats__"))
                yield batch
        except Exception as err:
            # the exception's traceback keeps the iterator alive until interpreter exit, when torch no longer shuts
            # its workers down and multiprocessing waits for ever on workers that ignore SIGTERM: stop them now
            stop_workers(self._dataloader)
            if isinstance(err, (ConfigError, DataError)):
                raise type(err)(worker_message(err)) from None
            raise
        log.info(self.log_line())

    def log_line(self) -> str:
        return self.stats.log_line()

"""ITC queues under torch.distributed with unequal per-rank batch sizes (a last partial batch, a blank batch of
zero rows): 2 real gloo processes enqueue their own momentum features, and both ranks' queues must hold every
rank's rows in rank order, exactly as one process enqueuing the concatenation would."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mplug_pretrain.models.heads.itc import ImageTextContrastive

EMBED, QUEUE, WIDTH = 8, 12, 4
ROUNDS = [(3, 1), (2, 2), (0, 4), (5, 0)]  # rows per rank in each step: unequal, equal, one rank empty


def features(rank: int, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-and-step specific momentum features [rows, E] and ids [rows] (ids encode rank, step and row)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    image = torch.nn.functional.normalize(torch.randn(rows, EMBED, generator=g), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(rows, EMBED, generator=g), dim=-1)
    ids = torch.arange(rows) + 1000 * rank + 100 * step
    return image, text, ids


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        itc = ImageTextContrastive(WIDTH, EMBED, 0.07, QUEUE, momentum=True)
        for step, rows in enumerate(ROUNDS):
            itc.enqueue(*features(rank, step, rows[rank]))
        torch.save({k: v for k, v in itc.state_dict().items() if "queue" in k}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_with_unequal_batches_fill_the_same_queue(tmp_path):
    mp.start_processes(_rank_main, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    single = ImageTextContrastive(WIDTH, EMBED, 0.07, QUEUE, momentum=True)  # no process group: no gather
    for step, rows in enumerate(ROUNDS):
        parts = [features(rank, step, rows[rank]) for rank in range(2)]
        single.enqueue(*(torch.cat([p[i] for p in parts]) for i in range(3)))
    expected = {k: v for k, v in single.state_dict().items() if "queue" in k}
    assert int(expected["queue_count"]) == QUEUE and int(expected["queue_ptr"]) == sum(map(sum, ROUNDS)) % QUEUE
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert set(got) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"rank {rank} {key}")


def test_the_reference_queue_holds_the_last_rows_in_order():
    """The single-process reference itself, against a hand-built ring buffer of the ids."""
    single = ImageTextContrastive(WIDTH, EMBED, 0.07, QUEUE, momentum=True)
    ring = [-1] * QUEUE
    pointer = 0
    for step, rows in enumerate(ROUNDS):
        parts = [features(rank, step, rows[rank]) for rank in range(2)]
        single.enqueue(*(torch.cat([p[i] for p in parts]) for i in range(3)))
        for image_id in torch.cat([p[2] for p in parts]).tolist():
            ring[pointer] = image_id
            pointer = (pointer + 1) % QUEUE
    assert single.idx_queue.tolist() == ring

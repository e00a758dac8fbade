"""``heads.itc_negatives: global``: ITC on 2 ranks x 12 rows with every rank's momentum keys equals ITC on 1 rank
x 24 rows (the same 24 samples, a half-filled queue, same-id positives, momentum distillation): the mean of the two
ranks' losses equals the one-process loss, and the gradients averaged over the ranks (what DeepSpeed's all-reduce
does) equal the one-process gradients, fp32, 1e-5. Rank-local negatives (the paper's) give another loss."""

import pytest
import torch

from tests.helpers import two_rank_worker

pytestmark = pytest.mark.slow

WORKER = r'''
import json, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from test_itc_global_negatives import make_case, loss_and_grads
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
itc, inputs = make_case()
rows = slice(rank * 12, (rank + 1) * 12)
loss, grads = loss_and_grads(itc, {k: v[rows] for k, v in inputs.items()}, sys.argv[1])
for g in grads.values():
    dist.all_reduce(g)
    g /= world
loss_t = torch.tensor([loss])
dist.all_reduce(loss_t)
if rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"loss": float(loss_t) / world, "grads": {k: v.tolist() for k, v in grads.items()}}, f)
dist.destroy_process_group()
'''


def make_case():
    """A seeded ITC head (E = 8, queue of 32 with 16 filled) and 24 samples: image / text CLS states [24, 16]
    (through the projections: they carry the gradient), momentum features [24, 8], ids with repeats."""
    from mplug_pretrain.models.heads.itc import ImageTextContrastive
    torch.manual_seed(0)
    itc = ImageTextContrastive(width=16, embed_dim=8, temperature=0.07, queue_size=32, momentum=True)
    with torch.no_grad():
        itc.image_queue.copy_(torch.nn.functional.normalize(torch.randn(8, 32), dim=0))
        itc.text_queue.copy_(torch.nn.functional.normalize(torch.randn(8, 32), dim=0))
        itc.idx_queue.copy_(torch.arange(32) % 20)
        itc.queue_count.fill_(16)
    g = torch.Generator().manual_seed(1)
    inputs = {"image_cls": torch.randn(24, 16, generator=g), "text_cls": torch.randn(24, 16, generator=g),
              "image_m": torch.nn.functional.normalize(torch.randn(24, 8, generator=g), dim=1),
              "text_m": torch.nn.functional.normalize(torch.randn(24, 8, generator=g), dim=1),
              "idx": torch.tensor([i // 2 for i in range(24)])}  # pairs of rows share an image: cross-rank positives
    inputs["idx"][11], inputs["idx"][12] = 100, 100  # one positive pair straddles the two ranks
    return itc, inputs


def loss_and_grads(itc, inputs: dict, negatives: str) -> tuple[float, dict]:
    itc.zero_grad()
    loss = itc.loss(itc.image_features(inputs["image_cls"]), itc.text_features(inputs["text_cls"]),
                    inputs["image_m"], inputs["text_m"], inputs["idx"], alpha=0.4, negatives=negatives)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in itc.named_parameters() if p.grad is not None}
    return float(loss), grads


def _two_ranks(negatives: str, tmp_path) -> dict:
    return two_rank_worker(WORKER, negatives, tmp_path / f"{negatives}.json", __file__)


def test_global_negatives_on_two_ranks_equal_one_process(tmp_path):
    itc, inputs = make_case()
    loss, grads = loss_and_grads(itc, inputs, "rank")  # one process: its batch is the global batch
    two = _two_ranks("global", tmp_path)
    assert two["loss"] == pytest.approx(loss, abs=1e-5)
    assert set(two["grads"]) == set(grads) and {"vision_proj.weight", "text_proj.weight", "temp"} <= set(grads)
    for name, grad in grads.items():
        assert torch.allclose(torch.tensor(two["grads"][name]), grad, atol=1e-5), name
    local = _two_ranks("rank", tmp_path)  # the paper's rank-local negatives: another loss
    assert abs(local["loss"] - loss) > 1e-3

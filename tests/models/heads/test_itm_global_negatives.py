"""``heads.itm_negatives: global``: ITM on 2 ranks x 12 rows with hard negatives drawn from both ranks' rows equals
ITM on 1 rank x 24 rows with the same draws (the tiny model, eval mode, fp32; ids with repeats and a positive pair
straddling the ranks; each rank's text padded to its own length, the two lengths different): the mean of the two
ranks' losses equals the one-process loss, and the gradients of every parameter averaged over the ranks (what
DeepSpeed's all-reduce does) equal the one-process gradients. The draws reach the other rank's rows, never a row of
the same id; the model's own forward with ``itm_negatives: global`` gives the same loss as the pooled functions, and
rank-local negatives another one."""

import pytest
import torch

from tests.helpers import two_rank_worker

pytestmark = pytest.mark.slow
ROWS, PER_RANK = 24, 12

WORKER = r'''
import json, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from test_itm_global_negatives import make_case, rank_rows, pooled_loss, grads_of
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, batch = make_case("global")
local = rank_rows(batch, rank)
torch.manual_seed(100 + rank)
loss, negatives, drawn_from_other = pooled_loss(model, local, rank)
loss.backward()
grads = grads_of(model)
for g in grads.values():
    dist.all_reduce(g)
    g /= world
torch.manual_seed(100 + rank)  # the model's own forward draws the same negatives from the same RNG state
model.zero_grad()
forward_loss = model(local)["loss_itm"]
torch.manual_seed(100 + rank)
rank_local = make_case("rank")[0](local)["loss_itm"]  # the paper's rank-local draws: another loss
totals = torch.tensor([float(loss), float(forward_loss), float(drawn_from_other), float(rank_local)])
dist.all_reduce(totals)
chosen = [torch.zeros_like(negatives) for _ in range(world)]
dist.all_gather(chosen, negatives)
if rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"loss": float(totals[0]) / world, "forward_loss": float(totals[1]) / world,
                   "rank_local_loss": float(totals[3]) / world,
                   "drawn_from_other": int(totals[2]), "negatives": torch.cat(chosen, 1).tolist(),
                   "grads": {k: v.tolist() for k, v in grads.items()}}, f)
dist.destroy_process_group()
'''


def make_case(negatives: str = "global"):
    """The tiny model (seeded, eval mode: no dropout; only the ITM loss) and 24 samples: images, texts of lengths
    3-9 (rank 0's rows at most 7 tokens, rank 1's up to 9), ids in pairs with one pair straddling the ranks."""
    import mplug_pretrain  # noqa: F401
    from mplug_pretrain.models.presets import build_model
    torch.manual_seed(0)
    model = build_model("tiny", **{"heads.itm_negatives": negatives,
                                   "heads.loss_weights": {"itc": 0.0, "itm": 1.0, "mlm": 0.0, "prefixlm": 0.0}})
    model.eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.cat([torch.randint(3, 8, (PER_RANK,), generator=g), torch.randint(3, 10, (PER_RANK,), generator=g)])
    lengths[PER_RANK] = 9
    ids = torch.randint(1000, 30000, (ROWS, 9), generator=g)
    mask = (torch.arange(9)[None] < lengths[:, None]).long()
    ids[:, 0] = 101
    ids[torch.arange(ROWS), lengths - 1] = 102
    image_id = torch.tensor([i // 2 for i in range(ROWS)])
    image_id[PER_RANK - 1] = image_id[PER_RANK] = 100
    batch = {"image": torch.randn(ROWS, 3, 64, 64, generator=g), "input_ids": ids.masked_fill(mask == 0, 0),
             "attention_mask": mask, "image_id": image_id}
    return model, batch


def rank_rows(batch: dict, rank: int) -> dict:
    """A rank's 12 rows, its text trimmed to its own longest row (as the loader pads)."""
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    local = {k: v[rows] for k, v in batch.items()}
    longest = int(local["attention_mask"].sum(1).max())
    local["input_ids"], local["attention_mask"] = local["input_ids"][:, :longest], local["attention_mask"][:, :longest]
    return local


def pooled_loss(model, batch: dict, rank: int, negatives=None):
    """ITM through the pooled functions: (loss, the draws [2, B] as pool rows, how many lie outside this rank's
    rows). ``negatives`` [2, B] (image for text, text for image) replaces the draw (the one-process reference)."""
    from mplug_pretrain.models.heads.itm import HardNegatives
    from mplug_pretrain.models.heads.itm_pool import gather_pool, pool_examples, pool_negatives
    from mplug_pretrain.models.towers.text import pool_text
    ids, mask, idx = batch["input_ids"], batch["attention_mask"], batch["image_id"]
    image_states, text_states = model.encode_image(batch["image"]), model.encode_text(ids, mask)
    image_feat = model.itc.image_features(image_states[:, 0])
    text_feat = model.itc.text_features(pool_text(text_states, mask, model.config.itc_pooling))
    pool = gather_pool(image_states, text_states, mask, image_feat, text_feat, idx)
    if negatives is None:
        drawn = pool_negatives(pool, image_feat, text_feat, model.itc.similarities)
    else:
        valid = ~(idx[:, None] == pool.ids[None, :]).all(1)
        drawn = HardNegatives(negatives[0], negatives[1], valid, valid.clone())
    examples = pool_examples(image_states, text_states, mask, pool, drawn)
    _, fused = model.fuse(examples.images, None, examples.texts, examples.text_mask, examples.image_rows)
    loss = model.itm_head.loss(fused[:, 0], examples.labels, examples.weights)
    chosen = torch.stack([drawn.image_for_text, drawn.text_for_image])
    own = range(pool.offset, pool.offset + ids.shape[0])
    assert not (idx[:, None] == pool.ids[chosen.t()]).any(), "a drawn negative shares its row's id"
    return loss, chosen, sum(int(j) not in own for j in chosen.flatten())


def grads_of(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _two_ranks(negatives: str, tmp_path) -> dict:
    return two_rank_worker(WORKER, negatives, tmp_path / f"{negatives}.json", __file__)


def test_global_itm_negatives_on_two_ranks_equal_one_process_with_the_same_draws(tmp_path):
    two = _two_ranks("global", tmp_path)
    assert two["drawn_from_other"] > 0  # the pool is both ranks' rows
    assert two["forward_loss"] == pytest.approx(two["loss"], abs=1e-6)  # MPLUG.forward takes the pooled path
    model, batch = make_case()
    longest = int(batch["attention_mask"].sum(1).max())
    batch["input_ids"], batch["attention_mask"] = batch["input_ids"][:, :longest], batch["attention_mask"][:, :longest]
    loss, _, _ = pooled_loss(model, batch, 0, negatives=torch.tensor(two["negatives"]))
    loss.backward()
    grads = grads_of(model)
    assert two["loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    assert set(two["grads"]) == set(grads)
    assert any(name.startswith("image_encoder.") for name in grads)  # the gathered rows carried their gradient
    assert any(name.startswith("text_encoder.") for name in grads)
    for name, grad in grads.items():
        assert torch.allclose(torch.tensor(two["grads"][name]), grad, atol=1e-5, rtol=1e-4), name
    assert abs(two["rank_local_loss"] - two["forward_loss"]) > 1e-4

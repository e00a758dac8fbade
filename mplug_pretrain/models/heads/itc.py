"""Image-text contrastive loss (ITC) with momentum-feature queues and momentum distillation (ALBEF / mPLUG §3.3).

Features: f_v = normalize(vision_proj(v_cls)), f_l = normalize(text_proj(l_cls)), both [B, E] (E = 256).
Momentum features f'_v, f'_l come from the momentum encoders and ``vision_proj_m`` / ``text_proj_m``.
Queues (ring buffers of the last Q momentum features, their ids, a write pointer and a fill count):
    image_queue, text_queue [E, Q]; idx_queue [Q]; queue_ptr, queue_count (0-dim long).
With K = [f'_l ; text_queue] (B + Q_valid columns) and temperature tau (learnable, clamped to [0.001, 0.5]):
    s_i2t = f_v K^T / tau                                            [B, B + Q_valid]
    y_i2t[i, j] = 1[id_i == id_j] / sum_j 1[id_i == id_j]            (same-id positives; identity without ids)
    y~_i2t = alpha softmax(f'_v K^T / tau) + (1 - alpha) y_i2t       (momentum distillation)
    L_i2t = -mean_i sum_j y~_i2t[i, j] log softmax(s_i2t)[i, j];  L_t2i symmetric;  L_itc = (L_i2t + L_t2i) / 2
Only the filled part of the queues takes part (no random placeholder negatives before the queue is full).
``enqueue`` writes a batch at ``queue_ptr`` with wrap-around; a batch need not divide Q (a batch larger
than Q keeps its last Q rows). Under torch.distributed the features of all ranks are gathered first.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.utils import process_group


class ImageTextContrastive(nn.Module):
    def __init__(self, width: int, embed_dim: int, temperature: float, queue_size: int, momentum: bool):
        super().__init__()
        self.vision_proj = nn.Linear(width, embed_dim)
        self.text_proj = nn.Linear(width, embed_dim)
        self.vision_proj_m = nn.Linear(width, embed_dim) if momentum else None
        self.text_proj_m = nn.Linear(width, embed_dim) if momentum else None
        # shape [1], not 0-dim: DeepSpeed broadcasts parameters as byte views, which 0-dim tensors refuse
        self.temp = nn.Parameter(torch.full((1,), float(temperature)))
        self.queue_size = queue_size
        self.register_buffer("image_queue", torch.zeros(embed_dim, queue_size))
        self.register_buffer("text_queue", torch.zeros(embed_dim, queue_size))
        self.register_buffer("idx_queue", torch.full((queue_size,), -1, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue_count", torch.zeros((), dtype=torch.long))

    def image_features(self, image_cls: torch.Tensor, momentum: bool = False) -> torch.Tensor:
        proj = self.vision_proj_m if momentum else self.vision_proj
        return F.normalize(proj(image_cls), dim=-1)

    def text_features(self, text_cls: torch.Tensor, momentum: bool = False) -> torch.Tensor:
        proj = self.text_proj_m if momentum else self.text_proj
        return F.normalize(proj(text_cls), dim=-1)

    @torch.no_grad()
    def clamp_temperature(self) -> None:
        self.temp.clamp_(0.001, 0.5)

    def loss(self, image_feat: torch.Tensor, text_feat: torch.Tensor, image_feat_m: torch.Tensor,
             text_feat_m: torch.Tensor, idx: torch.Tensor | None = None, alpha: float = 0.0) -> torch.Tensor:
        """L_itc of the module docstring; inputs [B, E] (L2-normalized), idx [B] long (>= 0) or None."""
        b = image_feat.shape[0]
        if idx is not None and (idx.shape != (b,) or bool((idx < 0).any())):
            raise ValueError(f"image_id must be [B] = [{b}] non-negative ids, got shape {tuple(idx.shape)}")
        valid = int(self.queue_count)
        image_all = torch.cat([image_feat_m.t(), self.image_queue[:, :valid].to(image_feat_m.dtype)], dim=1)
        text_all = torch.cat([text_feat_m.t(), self.text_queue[:, :valid].to(text_feat_m.dtype)], dim=1)
        with torch.no_grad():
            if idx is None:
                pos = torch.zeros(b, b + valid, device=image_feat.device)
                pos[:, :b] = torch.eye(b, device=image_feat.device)
            else:
                idx_all = torch.cat([idx, self.idx_queue[:valid]])
                pos = (idx[:, None] == idx_all[None, :]).float()
            targets = pos / pos.sum(1, keepdim=True)
            if alpha > 0:
                sim_i2t_m = (image_feat_m @ text_all).float() / self.temp
                sim_t2i_m = (text_feat_m @ image_all).float() / self.temp
                target_i2t = alpha * sim_i2t_m.softmax(1) + (1 - alpha) * targets
                target_t2i = alpha * sim_t2i_m.softmax(1) + (1 - alpha) * targets
            else:
                target_i2t = target_t2i = targets
        sim_i2t = (image_feat @ text_all).float() / self.temp
        sim_t2i = (text_feat @ image_all).float() / self.temp
        loss_i2t = -(F.log_softmax(sim_i2t, dim=1) * target_i2t).sum(1).mean()
        loss_t2i = -(F.log_softmax(sim_t2i, dim=1) * target_t2i).sum(1).mean()
        return (loss_i2t + loss_t2i) / 2

    @torch.no_grad()
    def enqueue(self, image_feat_m: torch.Tensor, text_feat_m: torch.Tensor, idx: torch.Tensor | None) -> None:
        """Ring-buffer write of this step's momentum features (gathered over ranks)."""
        if idx is None:
            idx = torch.full((image_feat_m.shape[0],), -1, dtype=torch.long, device=image_feat_m.device)
        image_feat_m, text_feat_m, idx = (_gather_rows(t) for t in (image_feat_m, text_feat_m, idx))
        n, q = image_feat_m.shape[0], self.queue_size
        positions = (int(self.queue_ptr) + torch.arange(n, device=image_feat_m.device)) % q
        keep = slice(max(0, n - q), n)  # a batch larger than the queue: only its last Q rows survive
        self.image_queue[:, positions[keep]] = image_feat_m[keep].t().to(self.image_queue.dtype)
        self.text_queue[:, positions[keep]] = text_feat_m[keep].t().to(self.text_queue.dtype)
        self.idx_queue[positions[keep]] = idx[keep]
        self.queue_ptr.fill_((int(self.queue_ptr) + n) % q)
        self.queue_count.fill_(min(q, int(self.queue_count) + n))


def _gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` [n_rank, ...] over all ranks (ranks may hold different n: a last partial batch)."""
    world = process_group.world_size()
    if world == 1:
        return x
    sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], device=x.device))
    sizes = [int(s) for s in sizes]
    padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    chunks = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(chunks, padded.contiguous())
    return torch.cat([c[:s] for c, s in zip(chunks, sizes)])

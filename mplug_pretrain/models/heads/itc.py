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
Only the filled part of the queues takes part (no random placeholder negatives before the queue is full):
the unfilled columns are masked out of the softmax, so the shapes never depend on the fill (no host sync).
``enqueue`` writes a batch at ``queue_ptr`` with wrap-around; a batch need not divide Q (a batch larger
than Q keeps its last Q rows); pointer and count stay on the device. Under torch.distributed the features of
all ranks are gathered first. In-batch negatives are the rank's own batch (ALBEF / mPLUG), or with
``heads.itc_negatives: global`` every rank's batch (the momentum keys gathered; open_clip's local loss).
Precision: features, similarities, softmaxes and the loss are fp32 (an fp32 island inside a bf16 autocast
forward, utils/precision.py); the queues are fp32 buffers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mplug_pretrain.models.heads.rank_rows import gather_rows, rank_row_counts
from mplug_pretrain.utils import process_group
from mplug_pretrain.utils.host_syncs import check_on_device
from mplug_pretrain.utils.precision import fp32_island

TEMPERATURE_RANGE = (0.001, 0.5)  # tau is clamped to this (ALBEF)


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
        return _normalize_fp32(proj(image_cls))

    def text_features(self, text_cls: torch.Tensor, momentum: bool = False) -> torch.Tensor:
        proj = self.text_proj_m if momentum else self.text_proj
        return _normalize_fp32(proj(text_cls))

    def similarities(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [N, E] @ b [E, M] / tau in fp32 (never a bf16 product cast afterwards) -> logits [N, M] fp32."""
        with fp32_island(a.device):
            return (a.float() @ b.float()) / self.temp.float()

    @torch.no_grad()
    def clamp_temperature(self) -> None:
        self.temp.clamp_(*TEMPERATURE_RANGE)

    def loss(self, image_feat: torch.Tensor, text_feat: torch.Tensor, image_feat_m: torch.Tensor,
             text_feat_m: torch.Tensor, idx: torch.Tensor | None = None, alpha: float = 0.0,
             negatives: str = "rank") -> torch.Tensor:
        """L_itc of the module docstring; inputs [B, E] (L2-normalized), idx [B] long (>= 0) or None.
        ``negatives="global"``: the key columns are every rank's momentum features (gathered, in rank order), so
        each rank's queries see the global batch as in one process; the gradient flows through the local query
        rows only, as it does in one process (the keys are momentum features, or detached online ones)."""
        b = image_feat.shape[0]
        if idx is not None:
            if idx.shape != (b,):
                raise ValueError(f"image_id must be [B] = [{b}] non-negative ids, got shape {tuple(idx.shape)}")
            check_on_device((idx >= 0).all(), f"image_id must be [B] = [{b}] non-negative ids")
        if negatives not in ("rank", "global"):
            raise ValueError(f"negatives: 'rank' or 'global', got {negatives!r}")
        device = image_feat.device
        q = self.queue_size
        keys_image, keys_text, keys_idx, offset = image_feat_m, text_feat_m, idx, 0
        if negatives == "global" and process_group.world_size() > 1:
            sizes = rank_row_counts(b, device)
            offset = sum(sizes[:process_group.rank()])
            keys_image, keys_text = (gather_rows(t.detach().float(), sizes) for t in (image_feat_m, text_feat_m))
            keys_idx = None if idx is None else gather_rows(idx, sizes)
        n = keys_image.shape[0]
        with fp32_island(device):
            filled = torch.cat([torch.ones(n, dtype=torch.bool, device=device),
                                torch.arange(q, device=device) < self.queue_count])  # [N + Q] columns in use
            image_all = torch.cat([keys_image.float().t(), self.image_queue.float()], dim=1)
            text_all = torch.cat([keys_text.float().t(), self.text_queue.float()], dim=1)
            with torch.no_grad():
                if idx is None:
                    pos = torch.zeros(b, n + q, device=device)
                    rows = torch.arange(b, device=device)
                    pos[rows, offset + rows] = 1.0
                else:
                    idx_all = torch.cat([keys_idx, self.idx_queue])
                    pos = ((idx[:, None] == idx_all[None, :]) & filled).float()
                targets = pos / pos.sum(1, keepdim=True)
                if alpha > 0:
                    sim_i2t_m = _mask_columns(self.similarities(image_feat_m, text_all), filled)
                    sim_t2i_m = _mask_columns(self.similarities(text_feat_m, image_all), filled)
                    target_i2t = alpha * sim_i2t_m.softmax(1) + (1 - alpha) * targets
                    target_t2i = alpha * sim_t2i_m.softmax(1) + (1 - alpha) * targets
                else:
                    target_i2t = target_t2i = targets
            sim_i2t = _mask_columns(self.similarities(image_feat, text_all), filled)
            sim_t2i = _mask_columns(self.similarities(text_feat, image_all), filled)
            loss_i2t = -(F.log_softmax(sim_i2t, dim=1) * target_i2t).sum(1).mean()
            loss_t2i = -(F.log_softmax(sim_t2i, dim=1) * target_t2i).sum(1).mean()
            return (loss_i2t + loss_t2i) / 2

    @torch.no_grad()
    def enqueue(self, image_feat_m: torch.Tensor, text_feat_m: torch.Tensor, idx: torch.Tensor | None) -> None:
        """Ring-buffer write of this step's momentum features (gathered over ranks)."""
        if idx is None:
            idx = torch.full((image_feat_m.shape[0],), -1, dtype=torch.long, device=image_feat_m.device)
        sizes = rank_row_counts(image_feat_m.shape[0], image_feat_m.device)
        image_feat_m, text_feat_m, idx = (gather_rows(t, sizes) for t in (image_feat_m, text_feat_m, idx))
        n, q = image_feat_m.shape[0], self.queue_size
        positions = (self.queue_ptr + torch.arange(n, device=image_feat_m.device)) % q  # on the device: no sync
        keep = slice(max(0, n - q), n)  # a batch larger than the queue: only its last Q rows survive
        self.image_queue[:, positions[keep]] = image_feat_m[keep].t().to(self.image_queue.dtype)
        self.text_queue[:, positions[keep]] = text_feat_m[keep].t().to(self.text_queue.dtype)
        self.idx_queue[positions[keep]] = idx[keep]
        self.queue_ptr.copy_((self.queue_ptr + n) % q)
        self.queue_count.copy_((self.queue_count + n).clamp(max=q))


def _normalize_fp32(x: torch.Tensor) -> torch.Tensor:
    with fp32_island(x.device):
        return F.normalize(x.float(), dim=-1)


def _mask_columns(logits: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """Unfilled queue columns out of every softmax: the most negative finite fp32 (exp gives exactly 0, and
    times a zero target it stays 0, where -inf would give NaN)."""
    return logits.masked_fill(~filled, torch.finfo(logits.dtype).min)

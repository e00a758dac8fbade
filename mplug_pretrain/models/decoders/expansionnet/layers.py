"""ExpansionNet v2 primitives (Hu et al., arXiv:2208.06551): static / block static expansion,
dynamic expansion, and the linear combination of all layers' outputs.

An expansion layer replaces self-attention. It scores the L inputs against expansion queries Q_E with
ReLU instead of softmax, spreads them over a different number of slots (static: sum(G), whatever L;
dynamic: L * N_E), adds biases B_E, maps back to L outputs with the transposed scores, runs twice
(ReLU(-M) and ReLU(+M)) and mixes the two streams with a sigmoid gate:

    M        = Q_E K^T / sqrt(d)                                   Eq. 2
    R_fw_i   = Psi(ReLU((-1)^i M))                                 Eq. 3
    Psi(X)ij = x_ij / (sum_z x_iz + eps)                           Eq. 4  (always computed in fp32)
    F_i      = R_fw_i V_i + B_E                                    Eq. 5
    R_bw_i   = Psi(ReLU((-1)^i M^T));  out_i = R_bw_i F_i          Eq. 6, 7
    y        = sigmoid(S) * out_1 + (1 - sigmoid(S)) * out_2       Eq. 8  (S: d -> d, as in the code)

Masked entries are zeroed after ReLU and before Psi, so each row renormalises over its admissible
entries; an all-masked row gives 0 (eps turns 0/0 into 0, which is why Psi runs in fp32: in bf16 the
eps underflows). Dropout is applied to M, to the forward products and to the backward products, in the
official code's places: static expansion drops F_i = R_fw V + B_E as a whole (biases included); dynamic
expansion drops R_fw V and adds B_E afterwards (the official block adds its biases inside the backward product).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EPS = 1e-9  # official ExpansionNet v2 value; safe because Psi runs in fp32


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def normalize_rows(scores: Tensor, eps: float = EPS) -> Tensor:
    """Psi (Eq. 4) over the last dim, in fp32 (or fp64 for fp64 input) even under bf16 autocast."""
    scores = _at_least_fp32(scores)
    return scores / (scores.sum(dim=-1, keepdim=True) + eps)


def normalize_rows_per_group(scores: Tensor, group_ids: Tensor, num_groups: int, eps: float = EPS) -> Tensor:
    """Psi applied separately to each group's column block of the last dim (block static backward).

    scores [..., N_tot], group_ids [N_tot] (group index of each column) -> at least fp32 [..., N_tot].
    """
    scores = _at_least_fp32(scores)
    sums = scores.new_zeros(*scores.shape[:-1], num_groups).index_add(-1, group_ids, scores)
    return scores / (sums.index_select(-1, group_ids) + eps)


class StaticExpansion(nn.Module):
    """Block static expansion over a set G of expansion coefficients (plain static: G = (N_E,)).

    x [B, L, d], key_valid [B, L] bool (True = real token; padding is masked in the forward step,
    as in the official code) -> [B, L, d]. The expanded sequence has sum(G) slots whatever L is.
    Queries and biases of all groups are stacked (Eq. 9); the forward step is one row-normalised
    product; the backward rows are normalised separately within each group's slots and the result
    is scaled by 1/|G| ("the length transformation matrix is scaled by the inverse number of
    elements in the group G").
    """

    def __init__(self, width: int, group: Sequence[int], dropout: float = 0.0, eps: float = EPS):
        super().__init__()
        group = tuple(int(n) for n in group)
        if not group or min(group) < 1:
            raise ValueError(f"expansion group: expected positive slot counts, got {group}")
        self.width, self.group, self.eps = width, group, eps
        total = sum(group)
        self.query_vectors = nn.Parameter(torch.empty(total, width))  # E_Q^G
        self.bias_vectors = nn.Parameter(torch.empty(total, width))  # E_B^G
        nn.init.xavier_uniform_(self.query_vectors)
        nn.init.xavier_uniform_(self.bias_vectors)
        self.key = nn.Linear(width, width)
        self.values = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])  # V_1, V_2
        self.gate = nn.Linear(width, width)  # S
        self.score_dropout = nn.Dropout(dropout)
        self.forward_dropout = nn.Dropout(dropout)
        self.backward_dropout = nn.Dropout(dropout)
        group_ids = torch.repeat_interleave(torch.arange(len(group)), torch.tensor(group))
        self.register_buffer("group_ids", group_ids, persistent=False)

    def _scores(self, x: Tensor) -> Tensor:
        """M = E_Q K^T / sqrt(d): [B, sum(G), L] (Eq. 2), with dropout."""
        m = self.query_vectors @ self.key(x).transpose(-1, -2) / math.sqrt(self.width)
        return self.score_dropout(m)

    def _expand(self, x: Tensor, m: Tensor, key_valid: Tensor | None) -> list[Tensor]:
        expanded = []
        for sign, value in zip((-1.0, 1.0), self.values):  # stream i = 1 uses -M, i = 2 uses +M
            r = F.relu(sign * m)
            if key_valid is not None:
                r = r.masked_fill(~key_valid[:, None, :], 0.0)
            v = value(x)
            # official order: dropout after adding the biases (ExpansionNet v2 StaticExpansionBlock)
            expanded.append(self.forward_dropout(normalize_rows(r, self.eps).to(v.dtype) @ v + self.bias_vectors))
        return expanded

    def expand(self, x: Tensor, key_valid: Tensor | None = None) -> list[Tensor]:
        """The two expanded sequences F_1, F_2 (Eq. 5), each [B, sum(G), d]."""
        return self._expand(x, self._scores(x), key_valid)

    def forward(self, x: Tensor, key_valid: Tensor | None = None) -> Tensor:
        m = self._scores(x)
        outs = []
        for sign, f in zip((-1.0, 1.0), self._expand(x, m, key_valid)):
            r = normalize_rows_per_group(F.relu(sign * m.transpose(-1, -2)), self.group_ids, len(self.group), self.eps)
            outs.append(self.backward_dropout(r.to(f.dtype) @ f) / len(self.group))
        g = torch.sigmoid(self.gate(x))
        return g * outs[0] + (1.0 - g) * outs[1]


class DynamicExpansionState(NamedTuple):
    """Everything the next incremental call needs (all [B, ...] along dim 0; slots position-major).

    keys, values_1, values_2: [B, T, d]; queries: [B, T * N_E, d] (Q_E of every past slot, for the
    backward row of a new output); expanded_1, expanded_2: [B, T * N_E, d] (F_i, biases included).
    """
    keys: Tensor
    values_1: Tensor
    values_2: Tensor
    queries: Tensor
    expanded_1: Tensor
    expanded_2: Tensor


class DynamicExpansion(nn.Module):
    """Dynamic expansion: L * N_E slots, queries and biases built by BroadSum (Eq. 1):

        Q_E[(t, n)] = C_t + E_Q[n],   B_E[(t, n)] = C_t + E_B[n],   C = W_c x

    forward(x [B, T_new, d], key_valid [B, T_past + T_new] bool, state=None) -> (y [B, T_new, d], state)

    causal=True: slot (t, n) reads inputs s <= t (forward), output s reads slots of positions t <= s
    (backward); padding (key_valid False) is masked as a key in both directions. Then F of a slot and
    the backward row of an output never change once computed, so `state` is an exact incremental
    cache: feeding tokens in chunks with the returned state equals the full computation.
    causal=False: the bidirectional variant (padding-aware, no incremental use).
    """

    def __init__(self, width: int, slots: int, dropout: float = 0.0, causal: bool = True, eps: float = EPS):
        super().__init__()
        if slots < 1:
            raise ValueError(f"expansion_slots: expected >= 1, got {slots}")
        self.width, self.slots, self.causal, self.eps = width, slots, causal, eps
        self.query_vectors = nn.Parameter(torch.empty(slots, width))  # E_Q
        self.bias_vectors = nn.Parameter(torch.empty(slots, width))  # E_B
        nn.init.xavier_uniform_(self.query_vectors)
        nn.init.xavier_uniform_(self.bias_vectors)
        self.condition = nn.Linear(width, width)  # C
        self.key = nn.Linear(width, width)
        self.values = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])  # V_1, V_2
        self.gate = nn.Linear(width, width)  # S
        self.score_dropout = nn.Dropout(dropout)
        self.forward_dropout = nn.Dropout(dropout)
        self.backward_dropout = nn.Dropout(dropout)

    def _admissible(self, key_valid: Tensor, t_new: int) -> Tensor:
        """[B, T_new, T] bool: new position q (absolute T_past + q) may use position s."""
        t_total = key_valid.shape[1]
        allowed = key_valid[:, None, :].expand(-1, t_new, -1)
        if self.causal:
            query_pos = torch.arange(t_total - t_new, t_total, device=key_valid.device)
            allowed = allowed & (torch.arange(t_total, device=key_valid.device)[None, :] <= query_pos[:, None])
        return allowed

    def forward(self, x: Tensor, key_valid: Tensor,
                state: DynamicExpansionState | None = None) -> tuple[Tensor, DynamicExpansionState]:
        b, t_new, d = x.shape
        n_e = self.slots
        if state is not None and not self.causal:
            raise ValueError("DynamicExpansion: an incremental state needs causal=True")
        cond = self.condition(x)[:, :, None, :]
        q_new = (cond + self.query_vectors).reshape(b, t_new * n_e, d)  # BroadSum, Eq. 1
        b_new = (cond + self.bias_vectors).reshape(b, t_new * n_e, d)
        k_new, v1_new, v2_new = self.key(x), self.values[0](x), self.values[1](x)
        if state is None:
            keys, v1, v2, queries = k_new, v1_new, v2_new, q_new
        else:
            keys = torch.cat([state.keys, k_new], 1)
            v1, v2 = torch.cat([state.values_1, v1_new], 1), torch.cat([state.values_2, v2_new], 1)
            queries = torch.cat([state.queries, q_new], 1)
        t_total = keys.shape[1]
        if key_valid.shape != (b, t_total):
            raise ValueError(f"DynamicExpansion: key_valid shape {tuple(key_valid.shape)}, expected {(b, t_total)}")
        allowed = self._admissible(key_valid, t_new)
        scale = 1.0 / math.sqrt(d)
        m_fw = self.score_dropout(q_new @ keys.transpose(-1, -2) * scale)  # rows of M for the new slots
        if t_new == t_total:
            m_bw = m_fw.transpose(-1, -2)  # Eq. 6 reuses the same M
        else:
            m_bw = self.score_dropout(k_new @ queries.transpose(-1, -2) * scale)  # columns of M at new keys
        fw_mask = ~allowed[:, :, None, :]  # slot (q, n) x key s
        bw_mask = ~allowed[:, :, :, None]  # output q x slot (t, n)
        expanded, outs = [], []
        past_expanded = (None, None) if state is None else (state.expanded_1, state.expanded_2)
        for sign, v, f_past in zip((-1.0, 1.0), (v1, v2), past_expanded):
            r_fw = F.relu(sign * m_fw).reshape(b, t_new, n_e, t_total).masked_fill(fw_mask, 0.0)
            r_fw = normalize_rows(r_fw, self.eps).reshape(b, t_new * n_e, t_total).to(v.dtype)
            f = self.forward_dropout(r_fw @ v) + b_new  # Eq. 5
            f = f if f_past is None else torch.cat([f_past, f], 1)
            r_bw = F.relu(sign * m_bw).reshape(b, t_new, t_total, n_e).masked_fill(bw_mask, 0.0)
            r_bw = normalize_rows(r_bw.reshape(b, t_new, t_total * n_e), self.eps).to(f.dtype)
            outs.append(self.backward_dropout(r_bw @ f))  # Eq. 7
            expanded.append(f)
        g = torch.sigmoid(self.gate(x))
        y = g * outs[0] + (1.0 - g) * outs[1]  # Eq. 8
        return y, DynamicExpansionState(keys, v1, v2, queries, expanded[0], expanded[1])


class LayerCombination(nn.Module):
    """"All layers are summed through a linear projection" (paper Sec. 3.4, code form):

        out = LayerNorm(X_N + Dropout(W [X_1; ...; X_N])),   W: N*d -> d

    layer_outputs: N tensors [B, L, d] -> [B, L, d]. Per position, so incremental decoding needs no cache.
    """

    def __init__(self, width: int, layers: int, dropout: float = 0.0):
        super().__init__()
        self.project = nn.Linear(layers * width, width)
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(width)

    def forward(self, layer_outputs: Sequence[Tensor]) -> Tensor:
        return self.norm(layer_outputs[-1] + self.dropout(self.project(torch.cat(list(layer_outputs), dim=-1))))

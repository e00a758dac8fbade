"""Model FLOPs of one pretraining sample, counted analytically from the model config (nanoGPT's
``estimate_mfu`` idea, extended to the four-loss mPLUG step), and MFU against the device's peak.

Only matrix products are counted (linear layers, the patch convolution, attention QK^T and AV, the ITC
similarity matrices): 2 FLOPs per multiply-add. Backward is counted as the products backprop performs:
one product for the weight gradient (trainable weights) and one for the input gradient (inputs that need a
gradient), so a plain layer costs 3x its forward (the "6 N tokens" rule), the patch convolution 2x (the
image needs no gradient), the no-grad momentum encoders 1x. Activation-checkpointing recomputation is not
counted (model FLOPs, not hardware FLOPs, as in PaLM's MFU). Causal attention is counted as full attention.

One pretraining sample with text length T runs (models/mplug.py ``forward``):
  ViT on 1 + (H/P)^2 tokens (+ projection) and the text encoder on T tokens       (ITC, shared)
  momentum ViT + momentum text encoder, forward only                             (ITC targets)
  ITC projections and similarities against B + queue columns (+ distillation targets)
  ITM: fusion over ``itm_rows`` pairs (1 positive + 2 hard negatives) + a 2-way head
  MLM: text encoder on the masked text, fusion, LM head at every position (the loss reads the masked ones)
  PrefixLM: text encoder + fusion on the prefix, decoder on the target with cross-attention to
            [image; prefix], LM head at every target position (prefix and target padded to T)
The cross-attention keys and values of the image states in the skip-connected fusion layers before the first
connected one are computed once per sample for all three fusion passes (``fusion.image_keys_values``), so they
are counted once, not per pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mplug_pretrain.models.fusion import fusion_schedule
from mplug_pretrain.models.model_config import ModelConfig

# dense bf16 peak FLOP/s (no sparsity) by a substring of torch.cuda.get_device_name()
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is 756e12, matched first below
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}
PEAK_OVERRIDES = {"H100 PCIe": 756e12}


@dataclass
class TextShapes:
    """Per-sample text shapes of one pretraining step. ``typical`` gives the expected shapes for a
    padded text length; tests pin them exactly (e.g. heads.mlm_probability = 1)."""
    text_len: int  # T: padded caption length ([CLS] .. [SEP])
    prefix_len: int  # PrefixLM prefix length ([CLS] c_1..c_k [SEP])
    target_len: int  # PrefixLM decoder length ([CLS] c_k+1..c_n [SEP])
    mlm_tokens: float  # positions the MLM head runs on per sample
    itm_rows: float = 3.0  # fused pairs per sample: positive + hard negative text + hard negative image

    @classmethod
    def typical(cls, text_len: int, mlm_probability: float = 0.15) -> TextShapes:
        """The shapes a pretraining step executes: the sync-free forward (models/heads) runs the MLM head on every
        position and pads the drawn PrefixLM prefix and target to T, so all four are T (``mlm_probability`` no
        longer changes the work; kept for callers)."""
        return cls(text_len=text_len, prefix_len=text_len, target_len=text_len, mlm_tokens=text_len)


@dataclass
class FlopCount:
    forward: float = 0.0
    backward: float = 0.0
    parts: dict = field(default_factory=dict)  # name -> forward + backward

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def product(self, name: str, flops: float, weight_grad: bool = True, input_grad: bool = True) -> None:
        """A matrix product of ``flops`` forward FLOPs; backward adds one such product per gradient."""
        back = flops * (int(weight_grad) + int(input_grad))
        self.forward += flops
        self.backward += back
        self.parts[name] = self.parts.get(name, 0.0) + flops + back


def _linear(n: float, d_in: float, d_out: float) -> float:
    return 2.0 * n * d_in * d_out


def _self_attention(n: float, d: float) -> float:
    """Q, K, V, out projections + QK^T + AV over n tokens of width d."""
    return 4 * _linear(n, d, d) + 2 * 2.0 * n * n * d


def _cross_attention(n: float, m: float, d: float) -> float:
    """Q/out on n query tokens, K/V on m source tokens, QK^T + AV."""
    return 2 * _linear(n, d, d) + 2 * _linear(m, d, d) + 2 * 2.0 * n * m * d


def _ffn(n: float, d: float, hidden: float) -> float:
    return _linear(n, d, hidden) + _linear(n, hidden, d)


def vision_forward(cfg: ModelConfig) -> tuple[float, float]:
    """(patch convolution, everything after it) forward FLOPs of one image through the image encoder."""
    v = cfg.vision
    grid = v.image_size // v.patch_size
    n = 1 + grid * grid
    patch = _linear(grid * grid, 3 * v.patch_size ** 2, v.width)
    blocks = v.layers * (_self_attention(n, v.width) + _ffn(n, v.width, int(v.width * v.mlp_ratio)))
    if v.width != cfg.text.width:
        blocks += _linear(n, v.width, cfg.text.width)
    return patch, blocks


def text_encoder_forward(cfg: ModelConfig, t: float) -> float:
    w = cfg.text.width
    return cfg.text.encoder_layers * (_self_attention(t, w) + _ffn(t, w, cfg.text.ffn_dim))


def shared_image_kv_layers(cfg: ModelConfig) -> int:
    """Skip-connected fusion layers before the first connected one: they see the image states unchanged, and the
    fusion passes of one step share their cross-attention keys and values (models/fusion.py)."""
    fc = cfg.fusion
    if fc.type != "skip":
        return 0
    schedule = fusion_schedule(fc.layers, fc.stride, fc.schedule_rule)
    return next((i for i, connected in enumerate(schedule) if connected), len(schedule))


def fusion_forward(cfg: ModelConfig, m: float, t: float, image_used: bool = True,
                   shared_kv: bool = False) -> tuple[float, float]:
    """(forward FLOPs that take a gradient, forward FLOPs that do not) of fusing m visual tokens with t text
    tokens. ITM and MLM read only the fused text: two-stream fusion's last image layer then gets no backward.
    ``shared_kv``: leave out the image keys / values the passes share (``shared_image_kv_layers``)."""
    w, f, fc = cfg.text.width, cfg.text.ffn_dim, cfg.fusion
    text_layer = _self_attention(t, w) + _cross_attention(t, m, w) + _ffn(t, w, f)
    joint_layer = _self_attention(m + t, w) + _ffn(m + t, w, f)
    if fc.type == "skip":
        total = sum(joint_layer if c else text_layer for c in fusion_schedule(fc.layers, fc.stride, fc.schedule_rule))
        if shared_kv:
            total -= shared_image_kv_layers(cfg) * 2 * _linear(m, w, w)
        return total, 0.0
    if fc.type == "all_connected":
        return fc.layers * joint_layer, 0.0
    if fc.type == "two_stream":
        image_layer = _self_attention(m, w) + _cross_attention(m, t, w) + _ffn(m, w, f)
        if image_used:
            return fc.layers * (text_layer + image_layer), 0.0
        return fc.layers * text_layer + (fc.layers - 1) * image_layer, image_layer
    raise ValueError(f"model.fusion.type: no FLOP count for {fc.type!r}")


def lm_head_forward(cfg: ModelConfig, n: float) -> float:
    w = cfg.text.width
    return _linear(n, w, w) + _linear(n, w, cfg.text.vocab_size)


def decoder_forward(cfg: ModelConfig, t: float, memory: float) -> float:
    d = cfg.decoder
    if d.type != "bert":
        raise ValueError(f"model.decoder.type: no FLOP count for {d.type!r} (only the bert decoder)")
    w = cfg.text.width
    layer = _self_attention(t, w) + _cross_attention(t, memory, w) + _ffn(t, w, d.ffn_dim)
    return d.layers * layer + lm_head_forward(cfg, t)


def pretrain_flops_per_sample(cfg: ModelConfig, shapes: TextShapes, batch_size: int,
                              queue: int | None = None, distill: bool = True) -> FlopCount:
    """FLOPs (forward + backward) of one sample of a pretraining step with every loss weight non-zero.

    batch_size: per-rank batch B (the ITC similarities have B + queue columns; with ranks > 1 the
    gathered columns are the same, only the queue differs). queue: filled queue columns (default: full).
    """
    if cfg.refiner.type != "none":
        raise ValueError(f"model.refiner.type: no FLOP count for {cfg.refiner.type!r}")
    h, w = cfg.heads, cfg.text.width
    queue = h.queue_size if queue is None else queue
    m = 1 + (cfg.vision.image_size // cfg.vision.patch_size) ** 2
    s = shapes
    c = FlopCount()
    patch, vision = vision_forward(cfg)
    c.product("vision", patch, input_grad=False)  # the image needs no gradient
    c.product("vision", vision)
    c.product("text", text_encoder_forward(cfg, s.text_len))
    c.product("itc", 2 * _linear(1, w, h.embed_dim))
    columns = batch_size + queue if h.use_momentum else batch_size
    c.product("itc", 2 * _linear(1, h.embed_dim, columns), weight_grad=False)  # sims vs. detached columns
    c.product("itm", _linear(1, h.embed_dim, batch_size), weight_grad=False, input_grad=False)  # hard negatives
    if h.use_momentum:
        c.product("momentum", patch + vision + text_encoder_forward(cfg, s.text_len) + 2 * _linear(1, w, h.embed_dim),
                  weight_grad=False, input_grad=False)
        if distill:
            c.product("momentum", 2 * _linear(1, h.embed_dim, columns), weight_grad=False, input_grad=False)
    c.product("fusion_kv", shared_image_kv_layers(cfg) * 2 * _linear(m, w, w))  # once for the three passes
    fused, unused = fusion_forward(cfg, m, s.text_len, image_used=False, shared_kv=True)
    c.product("itm", s.itm_rows * (fused + _linear(1, w, 2)))
    c.product("itm", s.itm_rows * unused, weight_grad=False, input_grad=False)
    c.product("mlm", text_encoder_forward(cfg, s.text_len) + fused + lm_head_forward(cfg, s.mlm_tokens))
    c.product("mlm", unused, weight_grad=False, input_grad=False)
    fused, _ = fusion_forward(cfg, m, s.prefix_len, image_used=True, shared_kv=True)  # decoder reads [image; prefix]
    c.product("prefixlm", text_encoder_forward(cfg, s.prefix_len) + fused
              + decoder_forward(cfg, s.target_len, m + s.prefix_len))
    return c


def peak_flops(device_name: str | None, cpu_peak: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU by name (None for an unknown card); on CPU (``device_name`` None)
    ``cpu_peak`` (run.cpu_peak_flops; None = MFU not reported on CPU)."""
    if device_name is None:
        return cpu_peak
    for key, value in {**PEAK_OVERRIDES, **PEAK_BF16_FLOPS}.items():
        if key in device_name:
            return value
    return None


def current_peak_flops(device, cpu_peak: float | None = None) -> float | None:
    import torch
    if getattr(device, "type", str(device)) == "cuda" or str(device).startswith("cuda"):
        return peak_flops(torch.cuda.get_device_name(device))
    return peak_flops(None, cpu_peak)


def mfu(flops_per_sample: float, samples_per_s_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s of one device over its peak (None without a peak)."""
    if not peak or flops_per_sample <= 0:
        return None
    return flops_per_sample * samples_per_s_per_device / peak

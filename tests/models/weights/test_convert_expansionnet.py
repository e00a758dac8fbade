"""Official ExpansionNet v2 checkpoint -> our expansion decoder / static refiner. The 'official outputs' come
from a functional re-implementation of the official layers (models/layers.py, End_ExpansionNet_v2.forward_enc /
forward_dec, eval mode) that reads the official key names directly; it shares no code with our modules."""
import argparse
import math

import pytest
import torch
import torch.nn.functional as F

import mplug_pretrain  # noqa: F401
from mplug_pretrain.cli import main
from mplug_pretrain.errors import ConfigError, DataError
from mplug_pretrain.models.decoders.expansionnet.decoder import ExpansionDecoder
from mplug_pretrain.models.decoders.expansionnet.encoder import StaticExpansionRefiner
from mplug_pretrain.models.model_config import DecoderConfig, VisualRefinerConfig
from mplug_pretrain.models.weights.expansionnet_official import (
    convert_expansionnet,
    load_converted,
    read_expansionnet_checkpoint,
)

D, FF, HEADS, VOCAB, MAX_LEN, N_ENC, N_DEC, N_EXP_DEC, ENC_GROUP, EPS = 16, 24, 2, 20, 10, 2, 2, 3, (2, 3, 4), 1e-9


def official_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {}

    def linear(name, n_out, n_in):
        sd[f"{name}.weight"] = torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in)
        sd[f"{name}.bias"] = 0.1 * torch.randn(n_out, generator=g)

    def norm(name):
        sd[f"{name}.weight"] = 1 + 0.2 * torch.randn(D, generator=g)
        sd[f"{name}.bias"] = 0.1 * torch.randn(D, generator=g)

    for n in range(N_ENC):
        p = f"encoders.{n}."
        norm(p + "norm_1"), norm(p + "norm_2")
        sd[p + "stc_exp.query_exp_vectors.weight"] = torch.randn(sum(ENC_GROUP), D, generator=g)
        sd[p + "stc_exp.bias_exp_vectors.weight"] = torch.randn(sum(ENC_GROUP), D, generator=g)
        for name in ("key_embed", "class_a_embed", "class_b_embed", "selector_embed"):
            linear(p + "stc_exp." + name, D, D)
        linear(p + "ff.linear_1", FF, D), linear(p + "ff.linear_2", D, FF)
    for n in range(N_DEC):
        p = f"decoders.{n}."
        norm(p + "norm_1"), norm(p + "norm_2"), norm(p + "norm_3")
        sd[p + "dyn_exp.query_exp_vectors.weight"] = torch.randn(N_EXP_DEC, D, generator=g)
        sd[p + "dyn_exp.bias_exp_vectors.weight"] = torch.randn(N_EXP_DEC, D, generator=g)
        for name in ("cond_embed", "key_linear", "class_a_embed", "class_b_embed", "selector_embed"):
            linear(p + "dyn_exp." + name, D, D)
        for name in ("Wq", "Wk", "Wv", "out_linear"):
            linear(p + "mha." + name, D, D)
        linear(p + "ff.linear_1", FF, D), linear(p + "ff.linear_2", D, FF)
    sd["out_embedder.embed.weight"] = torch.randn(VOCAB, D, generator=g)
    sd["pos_encoder.weight"] = torch.randn(MAX_LEN, D, generator=g)
    linear("enc_reduce_group", D, D * N_ENC), norm("enc_reduce_norm")
    linear("dec_reduce_group", D, D * N_DEC), norm("dec_reduce_norm")
    linear("vocab_linear", VOCAB, D)
    linear("input_linear", D, 12)
    sd["swin_transf.layers.0.blocks.0.attn.qkv.weight"] = torch.randn(6, 4, generator=g)
    return sd


def lin(sd, name, x):
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def ln(sd, name, x):
    return F.layer_norm(x, (D,), sd[f"{name}.weight"], sd[f"{name}.bias"])


def rownorm(x):
    return x / (x.sum(-1, keepdim=True) + EPS)


def official_static(sd, p, x):
    q, bias = sd[p + "query_exp_vectors.weight"], sd[p + "bias_exp_vectors.weight"]
    z = q @ lin(sd, p + "key_embed", x).transpose(-1, -2) / math.sqrt(D)
    class_a = rownorm(F.relu(z)) @ lin(sd, p + "class_a_embed", x) + bias
    class_b = rownorm(F.relu(-z)) @ lin(sd, p + "class_b_embed", x) + bias
    a_bw, b_bw, start = [], [], 0
    for size in ENC_GROUP:
        a_bw.append(rownorm(F.relu(z.transpose(-1, -2))[..., start:start + size]))
        b_bw.append(rownorm(F.relu(-z.transpose(-1, -2))[..., start:start + size]))
        start += size
    class_a = torch.cat(a_bw, -1) @ class_a / len(ENC_GROUP)
    class_b = torch.cat(b_bw, -1) @ class_b / len(ENC_GROUP)
    selector = torch.sigmoid(lin(sd, p + "selector_embed", x))
    return selector * class_a + (1 - selector) * class_b


def official_dynamic(sd, p, x):
    b, length, _ = x.shape
    cond = lin(sd, p + "cond_embed", x)[:, :, None, :]
    q = (sd[p + "query_exp_vectors.weight"] + cond).reshape(b, length * N_EXP_DEC, D)
    bias = (sd[p + "bias_exp_vectors.weight"] + cond).reshape(b, length * N_EXP_DEC, D)
    z = q @ lin(sd, p + "key_linear", x).transpose(-1, -2) / math.sqrt(D)
    no_peak = torch.tril(torch.ones(length, length))
    mask_1 = no_peak[:, None, :].expand(length, N_EXP_DEC, length).reshape(length * N_EXP_DEC, length)
    mask_2 = no_peak[:, :, None].expand(length, length, N_EXP_DEC).reshape(length, length * N_EXP_DEC)
    class_a = rownorm(F.relu(z) * mask_1) @ lin(sd, p + "class_a_embed", x)
    class_b = rownorm(F.relu(-z) * mask_1) @ lin(sd, p + "class_b_embed", x)
    class_a = rownorm(F.relu(z.transpose(-1, -2)) * mask_2) @ (class_a + bias)
    class_b = rownorm(F.relu(-z.transpose(-1, -2)) * mask_2) @ (class_b + bias)
    selector = torch.sigmoid(lin(sd, p + "selector_embed", x))
    return selector * class_a + (1 - selector) * class_b


def official_mha(sd, p, q_in, kv):
    b, t, _ = q_in.shape
    dk = D // HEADS

    def split(x):
        return x.view(b, -1, HEADS, dk).transpose(1, 2)
    q, k, v = split(lin(sd, p + "Wq", q_in)), split(lin(sd, p + "Wk", kv)), split(lin(sd, p + "Wv", kv))
    attn = torch.softmax(q @ k.transpose(-1, -2) / dk ** 0.5, -1)
    return lin(sd, p + "out_linear", (attn @ v).permute(0, 2, 1, 3).reshape(b, t, D))


def official_ff(sd, p, x):
    return lin(sd, p + "ff.linear_2", F.relu(lin(sd, p + "ff.linear_1", x)))


def official_encoder(sd, x):
    outs = []
    for n in range(N_ENC):
        p = f"encoders.{n}."
        x = x + official_static(sd, p + "stc_exp.", ln(sd, p + "norm_1", x))
        x = x + official_ff(sd, p, ln(sd, p + "norm_2", x))
        outs.append(x)
    return ln(sd, "enc_reduce_norm", x + lin(sd, "enc_reduce_group", torch.cat(outs, -1)))


def official_decoder(sd, memory, ids):
    y = sd["out_embedder.embed.weight"][ids] * math.sqrt(D) + sd["pos_encoder.weight"][:ids.shape[1]]
    outs = []
    for n in range(N_DEC):
        p = f"decoders.{n}."
        y = y + official_dynamic(sd, p + "dyn_exp.", ln(sd, p + "norm_1", y))
        y = y + official_mha(sd, p + "mha.", ln(sd, p + "norm_2", y), memory)
        y = y + official_ff(sd, p, ln(sd, p + "norm_3", y))
        outs.append(y)
    y = ln(sd, "dec_reduce_norm", y + lin(sd, "dec_reduce_group", torch.cat(outs, -1)))
    return lin(sd, "vocab_linear", y)


def build_converted(result):
    dcfg = {k: v for k, v in result.decoder_config.items() if k not in ("vocab_size", "width")}
    decoder = ExpansionDecoder(DecoderConfig(**dcfg, dropout=0.0), result.decoder_config["vocab_size"], D)
    rcfg = result.refiner_config
    refiner = StaticExpansionRefiner(
        VisualRefinerConfig(type="static_expansion", layers=rcfg["layers"], expansion_slots=rcfg["expansion_slots"],
                            expansion_group=tuple(rcfg["expansion_group"])),
        D, 2, ffn_dim=rcfg["ffn_dim"], dropout=0.0)
    load_converted(decoder, result.decoder, "decoder")
    load_converted(refiner, result.refiner, "refiner")
    return decoder.eval(), refiner.eval()


def test_converted_weights_give_the_official_outputs():
    sd = official_state_dict()
    result = convert_expansionnet(sd, heads=HEADS, encoder_group=ENC_GROUP)
    assert result.unknown == []
    assert set(result.ignored) == {"input_linear.weight", "input_linear.bias",
                                   "swin_transf.layers.0.blocks.0.attn.qkv.weight"}
    decoder, refiner = build_converted(result)  # strict: raises on any missing / unexpected key
    g = torch.Generator().manual_seed(1)
    tokens = torch.randn(3, 5, D, generator=g)  # CLS + 2x2 grid; static expansion is position-free
    ids = torch.randint(0, VOCAB, (3, 7), generator=g)
    with torch.no_grad():
        memory = refiner(tokens)
        torch.testing.assert_close(memory, official_encoder(sd, tokens), rtol=1e-5, atol=1e-5)
        logits = decoder(ids, torch.ones(3, 7), memory, torch.ones(3, 5)).logits
        torch.testing.assert_close(logits, official_decoder(sd, memory, ids), rtol=1e-5, atol=1e-5)


def test_cli_converts_an_official_file_and_refuses_arbitrary_pickles(tmp_path):
    sd = official_state_dict()
    path = tmp_path / "official.pth"
    torch.save({"model_state_dict": {f"module.{k}": v for k, v in sd.items()}, "epoch": 3,
                "optimizer_state_dict": {"state": {}, "param_groups": []}}, path)
    assert main(["convert", "expansionnet", "--checkpoint", str(path), "--out", str(tmp_path / "out"),
                 "--heads", str(HEADS), "--encoder-group", ",".join(map(str, ENC_GROUP))]) == 0
    decoder_sd = torch.load(tmp_path / "out" / "decoder.pt", weights_only=True)
    expected = convert_expansionnet(sd, HEADS, ENC_GROUP)
    assert decoder_sd.keys() == expected.decoder.keys()
    torch.testing.assert_close(decoder_sd["layers.1.expansion.gate.weight"],
                               -sd["decoders.1.dyn_exp.selector_embed.weight"], rtol=0, atol=0)
    assert (tmp_path / "out" / "refiner.pt").exists() and (tmp_path / "out" / "expansionnet_conversion.json").exists()
    unsafe = tmp_path / "unsafe.pth"
    torch.save({"model_state_dict": sd, "args": argparse.Namespace(lr=1.0)}, unsafe)
    with pytest.raises(DataError, match="weights_only=True"):
        read_expansionnet_checkpoint(unsafe)
    assert main(["convert", "expansionnet", "--checkpoint", str(unsafe), "--out", str(tmp_path / "o2")]) == 3


def test_wrong_group_sizes_are_named():
    with pytest.raises(ConfigError, match="--encoder-group 32,64: sums to 96"):
        convert_expansionnet(official_state_dict(), HEADS, (32, 64))

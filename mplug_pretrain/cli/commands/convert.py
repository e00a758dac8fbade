"""``mplug convert expansionnet --checkpoint F --out DIR``: official ExpansionNet v2 weights -> ours."""
from __future__ import annotations

from mplug_pretrain.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert official checkpoints into our module state dicts")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="<kind>")
    e = kinds.add_parser("expansionnet", help="official ExpansionNet v2 -> expansion decoder + static refiner")
    e.add_argument("--checkpoint", required=True, help="official .pth ({'model_state_dict': ...})")
    e.add_argument("--out", required=True, help="folder for decoder.pt, refiner.pt, expansionnet_conversion.json")
    e.add_argument("--heads", type=int, default=None, help="cross-attention heads (not in the weights; default 8)")
    e.add_argument("--encoder-group", default=None,
                   help="block static expansion group sizes G, comma separated (only their sum is in the weights; "
                        "default 32,64,128,256,512)")
    e.add_argument("--compare", default=None, metavar="FILE",
                   help="the official model's outputs on a fixed input (torch.save of encoder_input, encoder_output, "
                        "decoder_ids, decoder_logits): checks --heads and --encoder-group, which the weights cannot "
                        "tell (models/weights/expansionnet_check.py)")
    e.set_defaults(func=run_expansionnet)


def parse_group(text: str) -> tuple[int, ...]:
    try:
        group = tuple(int(n) for n in text.split(","))
    except ValueError:
        group = ()
    if not group or min(group) < 1:
        raise ConfigError(f"--encoder-group {text}: expected positive integers separated by commas, e.g. 32,64,128")
    return group


def run_expansionnet(args) -> int:
    import os
    if not os.path.isfile(args.checkpoint):
        what = "a folder, not a file" if os.path.isdir(args.checkpoint) else "no such file"
        raise FileNotFoundError(f"--checkpoint {args.checkpoint}: {what} (expected the official ExpansionNet v2 .pth)")
    from mplug_pretrain.models.weights.expansionnet_official import (
        OFFICIAL_ENCODER_GROUP,
        OFFICIAL_HEADS,
        convert_expansionnet,
        read_expansionnet_checkpoint,
        write_conversion,
    )
    group = parse_group(args.encoder_group) if args.encoder_group else OFFICIAL_ENCODER_GROUP
    heads = OFFICIAL_HEADS if args.heads is None else args.heads
    result = convert_expansionnet(read_expansionnet_checkpoint(args.checkpoint), heads, group)
    if args.compare:
        from mplug_pretrain.models.weights.expansionnet_check import check_against_reference, read_reference
        checked = check_against_reference(result, read_reference(args.compare), args.compare)
    out = write_conversion(result, args.out)
    print(f"converted {len(result.decoder)} decoder and {len(result.refiner)} refiner tensors into {out} "
          f"({len(result.ignored)} ignored, {len(result.unknown)} unknown)")
    if args.compare:
        print("\n".join(checked))
    else:
        print(f"not in the weights, so not checked: --heads {heads}"
              + (f", --encoder-group {','.join(map(str, group))} (their sum is)" if result.refiner else "")
              + "; check them with --compare FILE, the official model's outputs on a fixed input")
    for key in result.unknown:
        print(f"unknown official key: {key}")
    return 0

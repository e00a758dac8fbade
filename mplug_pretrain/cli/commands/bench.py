"""``mplug bench <name>|all --out FILE.json``: benchmarks that write JSON (registry.BENCHES)."""
from __future__ import annotations

import json
import os

from mplug_pretrain.cli.registry import BENCHES
from mplug_pretrain.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that write JSON")
    p.add_argument("name", choices=sorted(BENCHES) + ["all"])
    p.add_argument("--out", required=True, help="output JSON file (or folder for `all`)")
    p.add_argument("--quick", action="store_true", help="small sizes (used by the tests)")
    p.add_argument("--profile", action="store_true",
                   help="train-step only: one step's time in matmul / attention / element-wise / optimizer / idle, "
                        "op, cast and host-sync counts (bench/train_step_profile.py)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.profile and args.name != "train-step":
        raise ConfigError(f"--profile: only `mplug bench train-step` profiles, not {args.name}")
    if args.profile:
        result = BENCHES[args.name]().run(args.out, quick=args.quick, profile=True)
    else:
        result = run_bench(args.name, args.out, quick=args.quick)
    if isinstance(result, dict) and "rows" in result:
        for row in result["rows"]:
            print(json.dumps(row))
    return 0


def run_bench(name: str, out: str, quick: bool = False) -> dict:
    """One benchmark into the JSON file ``out``, or ``all`` of them into the folder ``out``."""
    if name == "all":
        os.makedirs(out, exist_ok=True)
        results = {}
        for bench in BENCHES:
            print(f"[bench] {bench}", flush=True)
            results[bench] = run_bench(bench, os.path.join(out, bench.replace("-", "_") + ".json"), quick)
        return results
    return BENCHES[name]().run(out, quick=quick)

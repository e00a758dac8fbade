"""`mplug bench <name>` runs one benchmark (command_registry.BENCHES); `mplug bench all` runs every one into a
folder."""
from __future__ import annotations

import os

from mplug_pretrain.command_registry import BENCHES, import_task


def run_bench(name: str, out: str, quick: bool = False) -> dict:
    if name == "all":
        os.makedirs(out, exist_ok=True)
        results = {}
        for bench in BENCHES:
            print(f"[bench] {bench}", flush=True)
            results[bench] = run_bench(bench, os.path.join(out, bench.replace("-", "_") + ".json"), quick)
        return results
    return import_task(BENCHES, name, f"mplug bench {name}").run(out, quick=quick)

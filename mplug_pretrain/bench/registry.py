"""Name -> benchmark module. `mplug bench all` runs every one into a folder."""
from __future__ import annotations

import importlib
import importlib.util
import os

_ALL_BENCHES = {
    "dataloader": "mplug_pretrain.bench.dataloader",
    "fusion": "mplug_pretrain.bench.fusion",
    "train-step": "mplug_pretrain.bench.train_step",
    "cider": "mplug_pretrain.bench.cider",
    "generate": "mplug_pretrain.bench.generate",
    "feature-cache": "mplug_pretrain.bench.feature_cache",
    "data-peer": "mplug_pretrain.bench.data_peer",
    "attention-peer": "mplug_pretrain.bench.attention_peer",
}
# only benchmarks whose module has landed are offered
BENCHES = {name: mod for name, mod in _ALL_BENCHES.items() if importlib.util.find_spec(mod) is not None}


def run_bench(name: str, out: str, quick: bool = False) -> dict:
    if name == "all":
        os.makedirs(out, exist_ok=True)
        results = {}
        for bench in BENCHES:
            print(f"[bench] {bench}", flush=True)
            results[bench] = run_bench(bench, os.path.join(out, bench.replace("-", "_") + ".json"), quick)
        return results
    module = importlib.import_module(BENCHES[name])
    return module.run(out, quick=quick)

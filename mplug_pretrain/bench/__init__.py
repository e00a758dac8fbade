"""Benchmarks behind `mplug bench NAME --out FILE.json`. Each module exposes
``run(out: str, quick: bool = False) -> dict`` and writes its JSON through ``common.write_bench``."""

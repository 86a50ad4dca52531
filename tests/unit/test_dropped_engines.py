"""An engine nobody closed gives everything back once it is unreachable (runtime/training/state.py):
its claim on the device, its worker threads, its host regions, its files, its hooks on the
model, its stop handlers. An exception mid-training, a notebook cell run again, a Trainer nobody
ended: after ``gc.collect()`` the next engine finds the process as it was."""

from __future__ import annotations

import gc
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.runtime.hw.host_memory import host_arena_bytes
from protrain.runtime.training import live_engines
from tests.helpers import lm_batches, tiny_gpt, train_updates


def job(tmp_path: Path, **memory: Any) -> dict[str, Any]:
    return {
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3},
        "output_dir": str(tmp_path / "runs"),
        "memory": {"device_budget": "auto", **memory},
        "profiler": {"cache_dir": str(tmp_path / "cache")},
    }


# Every chunk offloaded through two buffers and a block's activations on disk: side streams, the
# host worker, a host arena, staging rings, activation files, hooks on every module.
BUSY = {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2, "block_modes": ["ssd", "swap"]}


def process_state() -> dict[str, Any]:
    # Until nothing more is found: a cycle whose finalizer frees another (an engine an earlier
    # test left to the collector) takes a second pass, and the baseline must not count it.
    for _ in range(5):
        if not gc.collect():
            break
    return {
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("protrain")),
        "open files": len(os.listdir("/proc/self/fd")),
        "host regions": host_arena_bytes(),
        "live engines": len(live_engines._LIVE),
        "sigint": signal.getsignal(signal.SIGINT),
    }


@pytest.fixture
def baseline() -> Iterator[dict[str, Any]]:
    yield process_state()


def hooks_on(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) + sum(
        len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()
    )


def busy_job(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "ssd").mkdir(exist_ok=True)
    return job(tmp_path, **BUSY, ssd={"path": str(tmp_path / "ssd")})


def test_an_exception_mid_training_leaves_nothing_once_collected(tmp_path: Path, baseline: dict[str, Any]) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)

    def train_until_it_fails() -> None:
        engine = runtime.initialize(tiny_gpt(0), config=busy_job(tmp_path))
        train_updates(engine, data, range(1))
        engine(input_ids=torch.zeros(2, 64, dtype=torch.long))  # fails inside forward: too long

    with pytest.raises(ValueError, match="exceeds"):
        train_until_it_fails()
    assert process_state() == baseline
    assert list((tmp_path / "ssd").iterdir()) == [], "activation directories left behind"
    # The whole device again: a second auto engine is not refused, and trains.
    with runtime.initialize(tiny_gpt(1), config=job(tmp_path)) as engine:
        train_updates(engine, data, range(2))


def test_an_engine_dropped_while_its_model_is_kept_lets_go_of_the_model(
    tmp_path: Path, baseline: dict[str, Any]
) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    model = tiny_gpt(0)
    before = hooks_on(model)
    engine = runtime.initialize(model, config=busy_job(tmp_path))
    train_updates(engine, data, range(1))
    assert hooks_on(model) > before and process_state() != baseline
    del engine  # a notebook cell run again rebinds the name
    assert process_state() == baseline
    assert hooks_on(model) == before, "the dropped engine's hooks left the model"
    del model
    assert process_state() == baseline


def test_with_exit_gives_everything_back_on_an_error(tmp_path: Path, baseline: dict[str, Any]) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with pytest.raises(RuntimeError, match="stop here"):
        with runtime.initialize(tiny_gpt(0), config=busy_job(tmp_path)) as engine:
            train_updates(engine, data, range(1))
            raise RuntimeError("stop here")
    del engine
    assert process_state() == baseline

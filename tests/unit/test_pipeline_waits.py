"""The exposed pipeline waits each update reports in metrics.jsonl (runtime/chunks/waits.py):
seconds the main thread really blocked, by kind, not the pipeline's own estimates."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.runtime.chunks.residency import ChunkResidency
from protrain.runtime.optim.adamw import ShardAdamW
from tests.helpers import lm_batches, tiny_gpt

SLOW_S = 0.03


def records(tmp_path: Path) -> list[dict[str, Any]]:
    (metrics,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]


def train(tmp_path: Path, steps: int) -> int:
    """Every chunk offloaded through one buffer (no prefetch: each gather is waited for)."""
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"n_persist": 0, "n_buffer": 1, "n_swap": 0, "n_checkpoint": 0},
        "output_dir": str(tmp_path / "runs"),
    }
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        for update in range(steps):
            out = engine(**data.batch(update, 0, 0))
            engine.backward(out.loss)
            engine.step()
        return engine.plan.num_chunks


def test_a_slow_gather_shows_as_exposed_transfer_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gather = ChunkResidency.gather_shard

    def slow_gather(self: ChunkResidency, master: torch.Tensor, out: torch.Tensor, **kwargs: Any) -> None:
        time.sleep(SLOW_S)
        gather(self, master, out, **kwargs)

    monkeypatch.setattr(ChunkResidency, "gather_shard", slow_gather)
    num_chunks = train(tmp_path, steps=2)
    for record in records(tmp_path):
        waits = record["waits"]
        assert set(waits) == {"transfer_s", "reduce_s", "host_s", "activation_s"}
        # Forward alone gathers every chunk into the one buffer, each waited for in full.
        assert waits["transfer_s"] >= 0.9 * SLOW_S * num_chunks, waits


def test_a_slow_host_worker_shows_as_exposed_host_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every chunk offloaded, no accumulation or clipping: each gradient is applied by CPU Adam on
    # the host worker as it arrives, through ShardAdamW.step_ (nothing else calls it here).
    step = ShardAdamW.step_

    def slow_step(self: ShardAdamW, *args: Any, **kwargs: Any) -> None:
        time.sleep(SLOW_S)
        step(self, *args, **kwargs)

    monkeypatch.setattr(ShardAdamW, "step_", slow_step)
    train(tmp_path, steps=2)
    for record in records(tmp_path):
        # The first chunk's early update is queued as backward ends: the step waits for it.
        assert record["waits"]["host_s"] >= 0.9 * SLOW_S, record["waits"]

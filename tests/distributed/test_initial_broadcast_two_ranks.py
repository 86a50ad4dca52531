"""Two real gloo ranks that build different models: ``initialize`` starts both from rank 0's
values without moving the model whole, its parameters broadcast chunk by chunk (persistent and
offloaded chunks alike, before sharding) and its buffers one by one, so training goes as rank 0's
model would go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.distributed.pool import RankPool
from tests.helpers import (
    assert_matches_reference,
    assert_state_equal,
    gpt_reference,
    lm_batches,
    tiny_gpt,
    train_updates,
)

STEPS = 8


def train_from_own_model(*, rank: int, output_dir: str) -> dict[str, Any]:
    from protrain import runtime

    model = tiny_gpt(rank)  # rank 1's values differ from rank 0's everywhere
    model.register_buffer("marker", torch.full((3,), float(rank)))
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"chunk_size": "64KiB", "n_persist": 5, "n_buffer": 3},
        "output_dir": output_dir,
    }
    engine = runtime.initialize(model, config=config)
    persistent = sum(chunk.persistent for chunk in engine.chunks.chunks)
    initial = engine.state_dict()
    marker = model.get_buffer("marker").clone()
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    train_updates(engine, data, range(STEPS), rank=rank)
    state = engine.state_dict()
    engine.close()
    return {"persistent": persistent, "initial": initial, "marker": marker, "state": state}


def test_every_rank_starts_from_rank_zeros_model_chunk_by_chunk(rank_pool: RankPool, tmp_path: Path) -> None:
    results = rank_pool.run(train_from_own_model, output_dir=str(tmp_path))
    rank_zero = {**tiny_gpt(0).state_dict(), "marker": torch.zeros(3)}
    assert 0 < results[0]["persistent"] < 12, "persistent and offloaded chunks both"
    for result in results:
        assert_state_equal(result["initial"], rank_zero)
        assert torch.equal(result["marker"], torch.zeros(3))
    assert_state_equal(results[1]["state"], results[0]["state"])
    reference = gpt_reference(accumulation=1, world_size=2, steps=STEPS, lr=1e-3, weight_decay=0.1)
    trained = {name: value for name, value in results[0]["state"].items() if name != "marker"}
    assert_matches_reference(trained, reference.fp32, reference.fp64)

"""adam, lion and sgd on two real gloo ranks: a plan with replicated, sharded and offloaded
chunks trains as plain PyTorch with the same optimizer over both ranks' data (the gradients
averaged as DDP does), with and without clipping and accumulation; both ranks end identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.pool import RankPool
from tests.helpers import assert_matches_reference, assert_state_equal, lm_batches, tiny_gpt
from tests.unit.test_optimizer_training import STEPS, job, reference

pytestmark = pytest.mark.timeout(300)

MIXED = {"chunk_size": "64KiB", "n_persist": 3, "n_replicate": 1, "n_buffer": 2, "block_modes": ["keep", "keep"]}


def train(*, rank: int, output_dir: str, case: str, accumulation: int, clip: float) -> dict[str, Any]:
    from protrain import runtime

    data = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=2)
    config = job(Path(output_dir), case, memory=MIXED, gradient_accumulation_steps=accumulation, gradient_clipping=clip)
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        for update in range(STEPS):
            for micro in range(accumulation):
                engine.backward(engine(**data.batch(update, micro, rank)).loss)
                engine.step()
        plan = engine.plan
        return {"state": engine.state_dict(), "layout": (plan.num_chunks, plan.n_persist, plan.n_replicate)}


@pytest.mark.parametrize(
    ("case", "accumulation", "clip"),
    [("adam", 2, 0.5), ("lion", 1, 0.0), ("sgd-momentum-dampening", 2, 0.5), ("sgd-nesterov", 1, 0.0)],
)
def test_two_ranks_train_as_plain_pytorch_with_the_rule(
    rank_pool: RankPool, tmp_path: Path, case: str, accumulation: int, clip: float
) -> None:
    results = rank_pool.run(train, output_dir=str(tmp_path), case=case, accumulation=accumulation, clip=clip)
    chunks, persistent, replicated = results[0]["layout"]
    assert chunks > persistent > replicated > 0, "offloaded, sharded persistent and replicated chunks"
    assert_state_equal(results[1]["state"], results[0]["state"])
    fp32, fp64, _ = reference(case, accumulation=accumulation, clip=clip, world_size=2)
    assert_matches_reference(results[0]["state"], fp32, fp64)

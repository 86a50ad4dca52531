"""Host bytes on two gloo ranks, every chunk offloaded: each rank's host shards hold its real
elements only, so together the ranks hold each parameter once (12 bytes per parameter with
gradients applied as they arrive, 16 with clipping), and the planner's per-rank figure is rank
0's (which holds every chunk's first shard, the largest share), to the byte."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from protrain.runtime.hw.host_memory import host_arena_bytes
from tests.distributed.pool import RankPool
from tests.helpers import lm_batches, tiny_gpt


def host_bytes_after_training(*, rank: int, output_dir: str, clip: float) -> dict[str, Any]:
    from protrain import runtime

    gc.collect()
    before = host_arena_bytes()[0]
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "gradient_clipping": clip,
        "optimizer": {"lr": 1e-3},
        "memory": {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2, "n_swap": 0, "n_checkpoint": 0},
        "output_dir": output_dir,
    }
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    model = tiny_gpt(0)
    with runtime.initialize(model, config=config) as engine:
        for update in range(2):
            out = engine(**data.batch(update, 0, rank))
            engine.backward(out.loss)
            engine.step()
        state = [
            tensor
            for chunk in engine.chunks.chunks
            if chunk.training is not None
            for tensor in (chunk.master, chunk.training.grad_shard)
            if tensor is not None
        ]
        return {
            "mapped": host_arena_bytes()[0] - before,
            "predicted": engine.plan.predicted_peak_host_bytes - engine.plan.host_fixed_bytes,
            "state_elements": sum(t.numel() for t in state),
            "parameters": sum(p.numel() for p in model.parameters()),
        }


@pytest.mark.parametrize(
    ("clip", "tensors"), [(0.0, 1), (1.0, 2)], ids=["applied-as-they-arrive", "clipping"]
)
def test_ranks_hold_each_parameter_once_and_rank_0_is_counted(
    rank_pool: RankPool, tmp_path: Path, clip: float, tensors: int
) -> None:
    ranks = rank_pool.run(host_bytes_after_training, output_dir=str(tmp_path / "runs"), clip=clip)
    parameters = ranks[0]["parameters"]
    # Master (and the gradient shard when kept) over both ranks: every parameter once, no padding.
    assert ranks[0]["state_elements"] + ranks[1]["state_elements"] == tensors * parameters
    assert ranks[0]["mapped"] == ranks[0]["predicted"]
    assert ranks[1]["mapped"] <= ranks[0]["mapped"]

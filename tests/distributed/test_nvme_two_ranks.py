"""Optimizer state on NVMe (``memory.ssd.n_optimizer``) on two real gloo ranks: each rank keeps
its shards' state in files of its own, and training ends bit-identical to keeping it in host
memory, with and without clipping and accumulation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.pool import RankPool
from tests.helpers import assert_state_equal, lm_batches, tiny_gpt

pytestmark = pytest.mark.timeout(300)

STEPS = 4


def train(*, rank: int, root: str, n_optimizer: int, accumulation: int, clip: float, precision: str) -> dict[str, Any]:
    from protrain import runtime

    data = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=2)
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "precision": precision,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {
            "chunk_size": "64KiB",
            "n_persist": 2,
            "n_buffer": 2,
            "block_modes": ["keep", "keep"],
            "ssd": {"path": f"{root}/nvme", "n_optimizer": n_optimizer},
        },
        "output_dir": f"{root}/runs",
    }
    losses = []
    with runtime.initialize(tiny_gpt(0), config=config) as engine:
        for update in range(STEPS):
            for micro in range(accumulation):
                out = engine(**data.batch(update, micro, rank))
                engine.backward(out.loss)
                losses.append(out.loss.item())
                engine.step()
        nvme = engine.chunks.store.tiers.nvme
        writes = 0 if nvme is None else nvme.counters.writes
        files = [] if nvme is None else sorted(path.name for path in nvme.run_dir.iterdir())
        return {"state": engine.state_dict(), "losses": losses, "writes": writes, "files": files}


@pytest.mark.parametrize(
    ("accumulation", "clip", "precision"),
    [(1, 0.0, "fp32"), (2, 0.05, "fp32"), (1, 0.0, "bf16")],
    ids=["accumulation-1", "accumulation-2-clipped", "bf16-masters-too"],
)
def test_two_ranks_train_bit_identically_with_state_on_nvme(
    rank_pool: RankPool, tmp_path: Path, accumulation: int, clip: float, precision: str
) -> None:
    kwargs = {"accumulation": accumulation, "clip": clip, "precision": precision}
    in_memory = rank_pool.run(train, root=str(tmp_path / "ram"), n_optimizer=0, **kwargs)
    moved = 4 if precision == "fp32" else 3  # of 10 offloaded chunks (3 in bf16)
    on_nvme = rank_pool.run(train, root=str(tmp_path / "nvme"), n_optimizer=moved, **kwargs)
    for rank in (0, 1):
        first = 8 if precision == "fp32" else 2  # the last ones of 12 chunks (5 in bf16)
        kept = accumulation > 1 or clip > 0  # the gradients in files too, written by every add
        suffixes = ("grad", "state") if kept else ("state",)
        names = [f"chunk{index:05d}.{suffix}" for index in range(first, first + moved) for suffix in suffixes]
        assert on_nvme[rank]["files"] == names
        assert on_nvme[rank]["writes"] == STEPS * moved * (1 + (accumulation if kept else 0))
        assert on_nvme[rank]["losses"] == in_memory[rank]["losses"]
    assert_state_equal(on_nvme[0]["state"], in_memory[0]["state"])
    assert_state_equal(on_nvme[1]["state"], on_nvme[0]["state"])
    assert list((tmp_path / "nvme" / "nvme").iterdir()) == []

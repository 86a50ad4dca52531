"""Two real gloo ranks with activation modes: every mix of keep, swap, checkpoint and ssd trains
bit-identically to the same engine keeping every activation, with chunks offloaded or not, and
matches plain PyTorch by DESIGN's oracle; each rank's activation files are its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from protrain_demo.gpt import GPTConfig
from tests.distributed.pool import RankPool
from tests.helpers import (
    assert_matches_reference,
    assert_state_equal,
    gpt_reference,
    lm_batches,
    tiny_gpt,
    train_engine,
)

FOUR_BLOCKS = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=2, d_model=64)
STEPS = 5


def run_modes(*, rank: int, output_dir: str, modes: list[str], offload: bool) -> dict[str, Any]:
    memory: dict[str, Any] = {"block_modes": modes, "ssd": {"path": str(Path(output_dir) / "ssd")}}
    if offload:
        memory.update(chunk_size="64KiB", n_persist=0, n_buffer=2)
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": memory,
        "output_dir": output_dir,
    }
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    state, losses = train_engine(tiny_gpt(0, FOUR_BLOCKS), data, config, steps=STEPS, rank=rank)
    return {"state": state, "losses": losses}


@pytest.mark.parametrize("offload", [False, True], ids=["resident-chunks", "offloaded-chunks"])
def test_two_ranks_train_bit_identically_under_mixed_modes(
    rank_pool: RankPool, tmp_path: Path, offload: bool
) -> None:
    kept = rank_pool.run(run_modes, output_dir=str(tmp_path / "keep"), modes=["keep"] * 4, offload=offload)
    mixed = rank_pool.run(
        run_modes,
        output_dir=str(tmp_path / "mixed"),
        modes=["ssd", "swap", "checkpoint", "keep"],
        offload=offload,
    )
    for rank in (0, 1):
        assert_state_equal(mixed[rank]["state"], kept[rank]["state"])
    # Checked once both ranks have closed (a rank looking while the other still trains would see
    # the other's live directory).
    ssd = tmp_path / "mixed" / "ssd"
    assert ssd.is_dir() and list(ssd.iterdir()) == [], "each rank removed its activation files at close"
    assert_state_equal(mixed[1]["state"], mixed[0]["state"])
    reference = gpt_reference(FOUR_BLOCKS, world_size=2, steps=STEPS, lr=1e-3, weight_decay=0.1)
    assert_matches_reference(mixed[0]["state"], reference.fp32, reference.fp64)

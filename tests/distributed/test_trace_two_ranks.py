"""logging.trace on two gloo ranks started without protrain-run: rank 0 makes the run folder and
every rank writes its own Chrome trace and memory timeline there (the folder is rank 0's, sent to
the others), each holding its own threads' chunk jobs."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

from protrain.runtime.observability.timeline_file import read_timeline, timeline_path, trace_path
from tests.distributed.pool import RankPool
from tests.helpers import lm_batches, tiny_gpt, train_engine


def traced_training(*, rank: int, output_dir: str) -> dict[str, Any]:
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "precision": "bf16",
        "optimizer": {"lr": 1e-3},
        "memory": {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2, "block_modes": ["swap", "keep"]},
        "logging": {"trace": {"start_step": 2, "steps": 1}},
        "output_dir": output_dir,
    }
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    train_engine(tiny_gpt(0), data, config, steps=3, rank=rank)
    return {"pid": os.getpid()}


def test_each_rank_writes_its_trace_and_timeline_in_rank_0s_run_folder(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    ranks = rank_pool.run(traced_training, output_dir=str(tmp_path / "runs"))
    (run_dir,) = (tmp_path / "runs").iterdir()
    for rank in (0, 1):
        with gzip.open(trace_path(run_dir, rank), "rt", encoding="utf-8") as file:
            events = json.load(file)["traceEvents"]
        labels = [e for e in events if str(e.get("name", "")).startswith("protrain.")]
        assert {e["name"].split(".")[1] for e in labels} >= {"gather", "reduce", "swap_out", "swap_in"}
        assert {e["pid"] for e in labels} == {ranks[rank]["pid"]}, "a rank's trace holds its own process"
        assert read_timeline(timeline_path(run_dir, rank)).rank == rank

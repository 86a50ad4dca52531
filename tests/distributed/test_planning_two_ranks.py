"""Ranks plan alike: every measured hardware figure is agreed across ranks (slowest rate,
longest time), and the searched plan is the same on both ranks even when each rank measured
its own machine differently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.distributed.pool import RankPool
from tests.helpers import lm_batches, tiny_gpt


def agree_different_measurements(*, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from protrain.profiler.profile import HardwareProfile
    from protrain.runtime.hw.distributed import DistContext
    from protrain.runtime.planning.hardware_probes import agree_hardware

    mine = HardwareProfile(
        device_kind="cpu",
        world_size=2,
        h2d_bytes_per_s=1e10 * (1 + rank),
        d2h_bytes_per_s=2e10 / (1 + rank),
        cpu_adam_params_per_s=1e9 + rank,
        device_adam_params_per_s=3e9 - rank,
        all_gather_bytes_per_s=5e9 + rank,
        reduce_scatter_bytes_per_s=6e9 - rank,
        collective_latency_s=1e-4 * (1 + rank),
        adam_segment_s=2e-5 / (1 + rank),
        memory_bytes_per_s=4e10 + rank,
        copies_overlap_compute=False,
    )
    ctx = DistContext(rank=rank, world_size=2, local_rank=rank, collective_device=torch.device("cpu"))
    assert dist.is_initialized()
    return agree_hardware(mine, ctx).to_dict()


def test_every_hardware_figure_is_agreed(rank_pool: RankPool) -> None:
    first, second = rank_pool.run(agree_different_measurements)
    assert first == second
    assert first["h2d_bytes_per_s"] == 1e10 and first["d2h_bytes_per_s"] == 1e10  # slowest rates
    assert first["memory_bytes_per_s"] == 4e10 and first["reduce_scatter_bytes_per_s"] == 6e9 - 1
    assert first["collective_latency_s"] == 2e-4 and first["adam_segment_s"] == 2e-5  # longest times


def plan_with_a_tight_budget(*, rank: int, output_dir: str) -> dict[str, Any]:
    from protrain import runtime

    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "memory": {"chunk_size": "64KiB", "device_budget": "2MiB"},
        "profiler": {"cache_dir": f"{output_dir}/cache-rank{rank}"},  # each rank measures anew
        "output_dir": output_dir,
    }
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=2).batch(0, 0, rank)
    engine = runtime.initialize(tiny_gpt(0), config=config, example_batch=batch)
    for update in range(2):
        out = engine(**lm_batches(micro_batch_size=2, accumulation=1, world_size=2).batch(update, 0, rank))
        engine.backward(out.loss)
        engine.step()
    plan = engine.plan.to_dict()
    engine.close()
    return plan


def test_both_ranks_search_the_same_plan_and_train_with_it(rank_pool: RankPool, tmp_path: Path) -> None:
    first, second = rank_pool.run(plan_with_a_tight_budget, output_dir=str(tmp_path))
    knobs = ("chunk_size", "n_persist", "n_buffer", "predicted_step_s", "predicted_peak_device_bytes")
    assert [first[k] for k in knobs] == [second[k] for k in knobs]
    assert first["rule"].startswith("search") and first["n_persist"] < first["num_chunks"]

"""The engine's flat collectives on two gloo ranks, and the gradient buffers backward reuses.

On gloo the chunk engine all-gathers and reduce-scatters with one exchange between two ranks, or
one broadcast or in-place reduce per rank (runtime/hw/distributed.py says why); these must give
exactly what torch's own flat collectives give. Backward's gradient buffers come from a small pool: a step with many
offloaded chunks keeps only a few alive, counted here from the live tensors themselves."""

from __future__ import annotations

import gc
import json
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.pool import RankPool
from tests.helpers import assert_matches_reference, gpt_reference, lm_batches, tiny_gpt

pytestmark = pytest.mark.timeout(300)


def flat_collectives(*, rank: int) -> list[str]:
    """Every case where ours and torch's differ (empty: all equal), at the pool's world size."""
    import torch.distributed as dist

    from protrain.runtime.hw.distributed import all_gather_flat, reduce_scatter_flat_, reduce_scatter_into

    world = dist.get_world_size()
    mismatches = []
    for shard_numel in (3, 1023, 1 << 16):
        for dtype in (torch.float32, torch.bfloat16):
            generator = torch.Generator().manual_seed(1000 * rank + shard_numel)
            full = torch.randn(world * shard_numel, generator=generator).to(dtype)
            shard = full[rank * shard_numel :][:shard_numel].clone()

            gathered = torch.full((world * shard_numel,), float("nan"), dtype=dtype)
            all_gather_flat(gathered, shard)
            expected = torch.empty_like(gathered)
            dist.all_gather_into_tensor(expected, shard)
            if not torch.equal(gathered, expected):
                mismatches.append(f"all-gather {shard_numel} {dtype}")

            # The shard may already be this rank's slice of the output (no copy then).
            in_place = torch.zeros(world * shard_numel, dtype=dtype)
            in_place[rank * shard_numel :][:shard_numel] = shard
            all_gather_flat(in_place, in_place[rank * shard_numel :][:shard_numel])
            if not torch.equal(in_place, expected):
                mismatches.append(f"all-gather in place {shard_numel} {dtype}")

            reduced = reduce_scatter_flat_(full.clone())  # its input is scratch
            expected_shard = torch.empty(shard_numel, dtype=dtype)
            dist.reduce_scatter_tensor(expected_shard, full.clone())
            if not same_sum(reduced, expected_shard, world):
                mismatches.append(f"reduce-scatter {shard_numel} {dtype}")

            # Into a buffer of the caller's (a staging buffer): over whatever it held.
            into = torch.full((shard_numel,), float("nan"), dtype=dtype)
            if reduce_scatter_into(into, full.clone()) is not into or not same_sum(into, expected_shard, world):
                mismatches.append(f"reduce-scatter into a buffer {shard_numel} {dtype}")
    return mismatches


def same_sum(ours: torch.Tensor, torchs: torch.Tensor, world: int) -> bool:
    """Two addends sum to the same bits in either order; more may be added in another order
    than torch's, which moves each element by a rounding of the partial sums at most."""
    if world == 2:
        return torch.equal(ours, torchs)
    ulp = torch.finfo(ours.dtype).eps * torchs.float().abs().max().clamp(min=1.0)
    return bool(((ours.float() - torchs.float()).abs() <= 4 * world * ulp).all())


def rank_averages(*, rank: int) -> list[str]:
    """Every case where the engine's average over the ranks (two gradients of one parameter
    entering a buffer, then the collective) differs from torch's sum of the two, collective,
    division by the world size (empty: none)."""
    import torch.distributed as dist

    from protrain.runtime.chunks.rank_average import RankAverage

    world = dist.get_world_size()
    mismatches = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        average = RankAverage(world, dtype, None)
        generator = torch.Generator().manual_seed(rank)
        first, second = (torch.randn(world * 1023, generator=generator).to(dtype) for _ in range(2))
        ours = torch.full_like(first, float("nan"))
        average.enter_(ours, first)
        average.add_(ours, second)
        summed = first + second
        whole, expected_whole = average.whole_(ours.clone()), summed.clone()
        dist.all_reduce(expected_whole)
        if not torch.equal(whole, expected_whole.div_(world)):
            mismatches.append(f"all-reduce {dtype}")
        part, expected_part = average.part_(ours.clone()), torch.empty(1023, dtype=dtype)
        dist.reduce_scatter_tensor(expected_part, summed.clone())
        if not same_sum(part, expected_part.div_(world), world):
            mismatches.append(f"reduce-scatter {dtype}")
    return mismatches


def test_gloo_flat_collectives_equal_torchs(rank_pool: RankPool) -> None:
    """Two ranks: one exchange each way (the reduce-scatter into a buffer), or a reduce per rank;
    gradients averaged by taking 1/2 as they enter give torch's bits (decisions/0015)."""
    assert rank_pool.run(flat_collectives) == [[], []]
    assert rank_pool.run(rank_averages) == [[], []]


def test_gloo_flat_collectives_equal_torchs_on_three_ranks() -> None:
    """More than two ranks: a broadcast per rank, a reduce per rank; three ranks' average is
    divided after the collective (1/3 is not exact)."""
    pool = RankPool(world_size=3)
    try:
        assert pool.run(flat_collectives) == [[], [], []]
        assert pool.run(rank_averages) == [[], [], []]
    finally:
        pool.shutdown()


def train_counting_gradient_buffers(*, rank: int, output_dir: str) -> dict[str, Any]:
    """Every chunk persistent (backward then never waits for the side stream, which would pace
    it), 64 KiB chunks, every reduction slowed down; at every parameter's gradient hook, count
    the gradient buffers still alive."""
    from protrain import runtime

    def config(n_persist: int) -> dict[str, Any]:
        return {
            "seed": 3,
            "micro_batch_size": 2,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
            "scheduler": {"type": "constant"},
            # Every knob set: no profiling step on the first batch (its own backward takes
            # buffers too, and what it leaves is garbage collected at an unknown time).
            "memory": {
                "chunk_size": "64KiB",
                "n_persist": n_persist,
                "n_buffer": 0 if n_persist else 2,
                "n_swap": 0,
                "n_checkpoint": 0,
                "n_replicate": 0,  # sharded: each reduction through the pool of buffers
            },
            "output_dir": output_dir,
        }

    with runtime.initialize(tiny_gpt(0), config=config(0)) as counting:
        num_chunks = counting.plan.num_chunks
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    engine = runtime.initialize(tiny_gpt(0), config=config(num_chunks))
    chunks = engine.chunks
    most_alive = 0
    reduce_part = chunks.reducer._reduce_part

    def slow_reduce_part(buffer: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)  # a slow link: reductions fall behind backward
        return reduce_part(buffer)

    chunks.reducer._reduce_part = slow_reduce_part

    # Every buffer backward takes, held weakly: what is counted is the buffers still alive.
    taken: dict[int, weakref.ref[torch.Tensor]] = {}
    take = chunks.reducer.grad_pool.take

    def take_and_watch(*, zeroed: bool = True) -> torch.Tensor:
        buffer = take(zeroed=zeroed)
        taken[id(buffer)] = weakref.ref(buffer)
        return buffer

    chunks.reducer.grad_pool.take = take_and_watch

    def count(_param: torch.nn.Parameter) -> None:
        nonlocal most_alive
        most_alive = max(most_alive, sum(1 for ref in taken.values() if ref() is not None))

    alive_after_backward: list[int] = []
    with engine:
        hooks = [p.register_post_accumulate_grad_hook(count) for p in engine.module.parameters()]
        for update in range(3):
            out = engine(**data.batch(update, 0, rank))
            engine.backward(out.loss)
            alive_after_backward.append(buffers_still_held(taken))
            engine.step()
        for hook in hooks:
            hook.remove()
        return {
            "state": engine.state_dict(),
            "trainable_chunks": sum(1 for c in chunks.chunks if c.info.trainable),
            "capacity": chunks.reducer.grad_pool.capacity,
            "most_alive": most_alive,
            "alive_after_backward": alive_after_backward,
        }


def buffers_still_held(taken: dict[int, weakref.ref[torch.Tensor]], patience_s: float = 2.0) -> int:
    """The buffers still alive once backward has returned. What a reference cycle (autograd's, a
    traceback's) holds is garbage, freed at the collector's next pass; a worker thread may drop
    its last reference a moment after its event fired (seen once in CI under load): both are
    given ``patience_s``. A buffer the engine keeps stays alive through it."""
    deadline = time.monotonic() + patience_s
    while True:
        gc.collect()
        alive = [ref() for ref in taken.values()]
        held = [buffer for buffer in alive if buffer is not None]
        if not held or time.monotonic() > deadline:
            return len(held)
        del alive, held
        time.sleep(0.05)


def test_backward_reuses_a_few_gradient_buffers(rank_pool: RankPool, tmp_path: Path) -> None:
    results = rank_pool.run(train_counting_gradient_buffers, output_dir=str(tmp_path))
    for result in results:
        # The pool's buffers in rotation, and one more while a module's parameters span two
        # chunks that fill together: not one per chunk waiting for its reduction, as before.
        assert result["trainable_chunks"] >= 10
        assert 2 <= result["capacity"] <= 4, result  # two, and up to two more the budget has room for
        assert 2 <= result["most_alive"] <= result["capacity"] + 1
        assert result["alive_after_backward"] == [0, 0, 0], "forward would carry gradient buffers"
    reference = gpt_reference(world_size=2, steps=3, lr=1e-3, weight_decay=0.1)
    assert_matches_reference(results[0]["state"], reference.fp32, reference.fp64)


def collectives_per_update(*, rank: int, output_dir: str, memory: dict[str, Any]) -> dict[str, Any]:
    """Three updates under ``memory``; each update's collectives from metrics.jsonl (rank 0's)
    and the plan's chunk count and chunk bytes."""
    from protrain import runtime
    from tests.helpers import train_updates

    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"chunk_size": "64KiB", "block_modes": ["keep", "keep"], **memory},
        "output_dir": output_dir,
    }
    with runtime.initialize(tiny_gpt(0), config=config) as engine:
        train_updates(engine, data, range(3), rank=rank)
        plan, layout = engine.plan, engine.chunks.layout
        chunk_bytes = layout.chunk_numel * 4
    return {
        "updates": update_collectives(output_dir),
        "num_chunks": plan.num_chunks,
        "chunk_mib": chunk_bytes / (1 << 20),
    }


def update_collectives(output_dir: str) -> list[dict[str, float]]:
    """Each update's ``collectives/*`` figures from the metrics.jsonl under ``output_dir`` (one
    engine's), by kind: calls and ``<kind>(MiB)``."""
    records = []
    for path in Path(output_dir).glob("*/metrics.jsonl"):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return [
        {k.removeprefix("collectives/"): v for k, v in record.items() if k.startswith("collectives/")}
        for record in records
        if "step" in record
    ]


@pytest.mark.parametrize("n_persist", ["all", 0], ids=["every-chunk-persistent", "every-chunk-offloaded"])
def test_metrics_count_each_updates_collectives(rank_pool: RankPool, tmp_path: Path, n_persist: Any) -> None:
    """metrics.jsonl says what each update communicated. Sharded chunks (ZeRO-3): each chunk's
    gradient is reduce-scattered once per micro-batch; a persistent chunk is all-gathered once
    after its update (its full copy refreshed), an offloaded one in forward and again in
    backward, but for the last ``n_buffer`` of forward, still in their buffers when backward
    starts (the cost model's count); the loss and the gradient header are all-reduced; nothing is
    broadcast."""
    memory: dict[str, Any] = {"n_persist": 0, "n_buffer": 2} if n_persist == 0 else {"n_replicate": 0}
    results = rank_pool.run(collectives_per_update, output_dir=str(tmp_path / str(n_persist)), memory=memory)
    found = results[0]
    chunks, chunk_mib = found["num_chunks"], found["chunk_mib"]
    assert len(found["updates"]) == 3
    for update in found["updates"][1:]:  # the first window also holds the plan's agreement
        assert update["reduce_scatter"] == chunks
        assert update["reduce_scatter(MiB)"] == pytest.approx(chunks * chunk_mib)
        gathers = chunks if n_persist == "all" else 2 * chunks - min(2, chunks)
        assert update["all_gather"] == gathers, update
        assert update["all_gather(MiB)"] == pytest.approx(gathers * chunk_mib)
        assert update["broadcast"] == 0
        assert update["all_reduce"] >= 1

"""A re-plan on two gloo ranks: both agree on the measured peak (the larger), search again, and
move their shards into the new layout together; training ends where the run without a re-plan
ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.pool import RankPool
from tests.helpers import assert_state_close, assert_state_equal, lm_batches, tiny_gpt
from tests.unit.test_planning import job
from tests.unit.test_replan import underestimated

pytestmark = pytest.mark.timeout(300)
STEPS = 8


def train(
    *, rank: int, root: str, budget: int | None, underestimate: bool, example: bool = True
) -> dict[str, Any]:
    from protrain import runtime

    data = lm_batches(micro_batch_size=16, accumulation=1, world_size=2)
    config = {**job(Path(root), device_budget=budget or "1GiB"), "micro_batch_size": 16}
    example_batch = data.batch(0, 0, rank) if example else None
    with runtime.initialize(tiny_gpt(), config=config, example_batch=example_batch) as engine:
        if underestimate:
            underestimated(engine, 0.5)
        for update in range(STEPS):
            out = engine(**data.batch(update, 0, rank))
            engine.backward(out.loss)
            engine.step()
        return {
            "state": engine.state_dict(),
            "replans": engine.replans,
            "peak": engine.plan.predicted_peak_device_bytes,
            "rule": engine.plan.rule,
        }


def test_two_ranks_re_plan_together(rank_pool: RankPool, tmp_path: Path) -> None:
    roomy = rank_pool.run(train, root=str(tmp_path / "a"), budget=None, underestimate=False)
    budget = int(roomy[0]["peak"] * 1.3)
    plain = rank_pool.run(train, root=str(tmp_path / "b"), budget=budget, underestimate=False)
    replanned = rank_pool.run(train, root=str(tmp_path / "c"), budget=budget, underestimate=True)
    assert [r["replans"] for r in plain] == [0, 0] and [r["replans"] for r in replanned] == [1, 1]
    assert replanned[0]["rule"] == replanned[1]["rule"] and replanned[0]["rule"].startswith("re-planned")
    assert_state_equal(replanned[1]["state"], replanned[0]["state"])
    assert_state_close(replanned[0]["state"], plain[0]["state"])


def test_two_ranks_plan_on_their_first_batch(rank_pool: RankPool, tmp_path: Path) -> None:
    roomy = rank_pool.run(train, root=str(tmp_path / "a"), budget=None, underestimate=False)
    budget = int(roomy[0]["peak"] * 0.75)
    planned_up_front = rank_pool.run(train, root=str(tmp_path / "b"), budget=budget, underestimate=False)
    on_first_batch = rank_pool.run(
        train, root=str(tmp_path / "c"), budget=budget, underestimate=False, example=False
    )
    assert on_first_batch[0]["rule"] == on_first_batch[1]["rule"]
    assert on_first_batch[0]["rule"].startswith("planned on a batch through the chunk engine: search")
    assert_state_equal(on_first_batch[1]["state"], on_first_batch[0]["state"])
    assert_state_close(on_first_batch[0]["state"], planned_up_front[0]["state"])


def train_offloaded(*, rank: int, root: str, budget: int | str) -> dict[str, Any]:
    """Micro-batches of 2, no example batch: the first batch is profiled and planned on."""
    from protrain import runtime

    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    config = job(Path(root), device_budget=budget)
    # Several profiling steps, each with all-gathers: the ranks must stop after the same one.
    config["profiler"] = {**config["profiler"], "profile_steps": 4}
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        start = engine.plan
        first = engine.plan
        for update in range(STEPS):
            out = engine(**data.batch(update, 0, rank))
            engine.backward(out.loss)
            engine.step()
            if update == 0:
                first = engine.plan  # a re-plan may follow once the peak is measured
        return {
            "state": engine.state_dict(),
            "start": (start.rule, start.n_persist),
            "plan": (first.rule, first.n_persist, first.num_chunks),
        }


def test_two_ranks_profile_a_model_larger_than_the_device_through_its_chunks(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """The budget is 2/3 of the model state: both ranks start with every chunk offloaded, profile
    the first batch through their chunks (all-gathers paired across ranks), agree on one plan,
    and end where a run with room to spare ends."""
    budget = 16 * sum(p.numel() for p in tiny_gpt().parameters()) * 2 // 3
    roomy = rank_pool.run(train_offloaded, root=str(tmp_path / "a"), budget="1GiB")
    tight = rank_pool.run(train_offloaded, root=str(tmp_path / "b"), budget=budget)
    assert [r["start"] for r in tight] == [tight[0]["start"]] * 2 and tight[0]["start"][1] == 0
    assert tight[0]["plan"] == tight[1]["plan"]
    rule, n_persist, num_chunks = tight[0]["plan"]
    assert rule.startswith("planned on a batch through the chunk engine: search") and n_persist < num_chunks
    assert_state_equal(tight[1]["state"], tight[0]["state"])
    assert_state_close(tight[0]["state"], roomy[0]["state"])

"""The Plan value: exact round trip, the resident rule, the block layout."""

from __future__ import annotations

import json

import pytest

from protrain.profiler.plan import BlockMode, Plan
from protrain.profiler.plan_builder import KnobRequest, default_block_layout, resident_plan


def make_plan(**overrides: object) -> Plan:
    values = dict(
        request=KnobRequest(),
        param_sizes=[(25 << 18, True)] * 4,
        element_size=4,
        num_blocks=4,
        world_size=2,
        micro_batch_size=4,
        precision="fp32",
        device_budget_bytes=1 << 30,
        host_budget_bytes=4 << 30,
        chosen=("memory.n_persist",),
    )
    values.update(overrides)
    return resident_plan(**values)  # type: ignore[arg-type]


def test_round_trip_through_json_is_exact() -> None:
    plan = make_plan(request=KnobRequest(n_swap=1, n_checkpoint=1))
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert again.block_modes == (BlockMode.SWAP, BlockMode.CHECKPOINT, BlockMode.KEEP, BlockMode.KEEP)


def test_plan_is_frozen_and_keyword_only() -> None:
    plan = make_plan()
    with pytest.raises(AttributeError):
        plan.n_persist = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        Plan(1, 2)  # type: ignore[misc]


def test_from_dict_rejects_unknown_fields_and_versions() -> None:
    body = make_plan().to_dict()
    with pytest.raises(ValueError, match="unknown plan fields"):
        Plan.from_dict({**body, "n_persistent": 3})
    with pytest.raises(ValueError, match="version"):
        Plan.from_dict({**body, "version": 99})


def test_resident_rule_keeps_everything_and_respects_hand_set_knobs() -> None:
    plan = make_plan()
    assert plan.all_resident and plan.n_persist == plan.num_chunks
    hand = make_plan(request=KnobRequest(chunk_size=50 << 20, n_persist=1, n_buffer=2))
    assert (hand.chunk_size, hand.num_chunks, hand.n_persist, hand.n_buffer) == (50 << 20, 2, 1, 2)
    assert not hand.all_resident


def test_auto_buffers_for_a_hand_set_n_persist_are_what_modules_need_plus_one_to_prefetch() -> None:
    # Four 25 MiB parameters in 25 MiB chunks: one chunk each. Module 0 owns parameters 0-1,
    # module 1 parameters 2-3, so a module spans two chunks.
    modules = [[0, 1], [2, 3]]
    plan = make_plan(request=KnobRequest(chunk_size=25 << 20, n_persist=0), module_params=modules)
    assert (plan.num_chunks, plan.n_buffer) == (4, 3)
    # Chunks 0-1 persistent: module 1 still needs two buffers; only two chunks are offloaded.
    plan = make_plan(request=KnobRequest(chunk_size=25 << 20, n_persist=2), module_params=modules)
    assert plan.n_buffer == 2
    plan = make_plan(request=KnobRequest(chunk_size=25 << 20, n_persist=3), module_params=modules)
    assert plan.n_buffer == 1
    assert make_plan(request=KnobRequest(chunk_size=25 << 20), module_params=modules).n_buffer == 0


def test_impossible_knobs_are_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the model's 4 chunks"):
        make_plan(request=KnobRequest(chunk_size=25 << 20, n_persist=5))
    with pytest.raises(ValueError, match="chunk_size=10.00 MiB is too small"):
        make_plan(request=KnobRequest(chunk_size=10 << 20))
    with pytest.raises(ValueError, match="exceeds the model's 4 blocks"):
        make_plan(request=KnobRequest(n_swap=3, n_checkpoint=2))
    with pytest.raises(ValueError, match="lists 2 modes but the model has 4 blocks"):
        make_plan(request=KnobRequest(block_modes=(BlockMode.KEEP, BlockMode.KEEP)))


def test_block_layout_order() -> None:
    layout = default_block_layout(8, n_offload=1, n_swap=2, n_checkpoint=2)
    assert [m.value for m in layout] == [
        "ssd",
        "swap",
        "checkpoint",
        "swap",
        "checkpoint",
        "keep",
        "keep",
        "keep",
    ]
    assert default_block_layout(3, n_offload=0, n_swap=0, n_checkpoint=2) == (
        BlockMode.CHECKPOINT,
        BlockMode.CHECKPOINT,
        BlockMode.KEEP,
    )


def test_rows_name_where_each_knob_came_from() -> None:
    rows = {knob: origin for knob, _, origin in make_plan().rows()}
    assert rows["n_persist"] == "auto" and rows["n_buffer"] == "spec"

"""The activation modes' cost (profiler/activation_cost.py) on a synthetic four-block profile,
every figure computed by hand; and its place in the plan search."""

from __future__ import annotations

import pytest

from protrain.profiler.activation_cost import activation_cost
from protrain.profiler.cost_model import chunk_costs, predict
from protrain.profiler.profile import BlockProfile, HardwareProfile, ModelProfile
from protrain.profiler.search import search


def model() -> ModelProfile:
    """Four blocks: forward 1 s, backward 2 s, 100 saved bytes, 10 input bytes each; outside the
    blocks 0.5 s forward, 1 s backward, 50 saved bytes."""
    return ModelProfile(
        batch_shape=(1, 8),
        precision="fp32",
        element_size=4,
        param_sizes=((256, True),) * 4,
        param_block=(0, 1, 2, 3),
        module_params=((0,), (1,), (2,), (3,)),
        blocks=(BlockProfile(forward_s=1.0, backward_s=2.0, activation_bytes=100, input_bytes=10),) * 4,
        other_forward_s=0.5,
        other_backward_s=1.0,
        other_activation_bytes=50,
        transient_bytes=0,
    )


def hardware(**overrides: float | bool) -> HardwareProfile:
    """Copies 1 s per block each way; the disk writes a block in 2 s and reads one in 1 s."""
    values: dict[str, float | bool] = dict(
        h2d_bytes_per_s=100.0,
        d2h_bytes_per_s=100.0,
        cpu_adam_params_per_s=1e9,
        device_adam_params_per_s=1e9,
        all_gather_bytes_per_s=float("inf"),
        reduce_scatter_bytes_per_s=float("inf"),
        collective_latency_s=0.0,
        ssd_write_bytes_per_s=50.0,
        ssd_read_bytes_per_s=100.0,
    )
    values.update(overrides)
    return HardwareProfile(device_kind="synthetic", world_size=1, **values)  # type: ignore[arg-type]


def test_keeping_every_block_costs_nothing_and_holds_every_activation() -> None:
    cost = activation_cost(model(), hardware(), ["keep"] * 4)
    assert (cost.forward_extra_s, cost.backward_extra_s) == (0.0, 0.0)
    assert cost.peak_bytes == 50 + 4 * 100 == model().activation_bytes
    assert (cost.host_bytes, cost.ssd_bytes) == (0, 0)


def test_checkpoint_keeps_inputs_and_recomputes_each_forward() -> None:
    cost = activation_cost(model(), hardware(), ["checkpoint"] * 4)
    assert cost.backward_extra_s == 4 * 1.0
    # End of forward: 50 + 4 x 10 = 90; the last block's backward recomputes its 100 bytes with
    # the three inputs below it alive, beside the private copy of its 1,024 bytes of parameters
    # the recomputation reads: 50 + 30 + 100 + 1024.
    assert cost.peak_bytes == 1204


def test_swap_hides_copies_behind_compute_where_they_overlap() -> None:
    cost = activation_cost(model(), hardware(), ["swap"] * 4)
    # Copies end at 2, 3, 4, 5 s; forward's blocks end at 4 s and the head runs 0.5 s more.
    assert cost.forward_extra_s == pytest.approx(0.5)
    # Reads of blocks 3 and 2 start with backward and finish at 1 and 2 s; block 3's backward
    # starts at 1 s (after the head's), and each later read finishes before its block is due.
    assert cost.backward_extra_s == 0.0
    # Block 3's backward holds its own 100 bytes and blocks 2 and 1 prefetched: 50 + 300.
    assert cost.peak_bytes == 350
    assert cost.host_bytes == 400


def test_swap_on_shared_cores_adds_every_copy() -> None:
    cost = activation_cost(model(), hardware(copies_overlap_compute=False), ["swap"] * 4)
    assert cost.forward_extra_s == pytest.approx(4.0)
    assert cost.backward_extra_s == pytest.approx(4.0)


def test_slow_disk_writes_show_in_forward_and_slow_reads_in_backward() -> None:
    cost = activation_cost(model(), hardware(), ["ssd"] * 4)
    # Writes of 2 s each, queued from 1 s: done at 9 s; forward ends at 4.5 s.
    assert cost.forward_extra_s == pytest.approx(4.5)
    assert cost.backward_extra_s == 0.0
    assert cost.ssd_bytes == 400 and cost.host_bytes == 0

    slow_reads = activation_cost(
        model(), hardware(ssd_write_bytes_per_s=1000.0, ssd_read_bytes_per_s=25.0), ["ssd"] * 4
    )
    assert slow_reads.forward_extra_s == 0.0
    # Reads of 4 s: blocks 3, 2 ready at 4, 8 s (issued at 0); block 1 issued at 1 s, ready at
    # 12; block 0 issued at 6 s, ready at 16. Waits: 3 (block 3 due at 1 s), 2 (block 2 due at
    # 6), 2 (block 1 due at 10), 2 (block 0 due at 14).
    assert slow_reads.backward_extra_s == pytest.approx(9.0)


def test_mixed_layout_peaks_where_prefetched_blocks_meet_kept_ones() -> None:
    cost = activation_cost(model(), hardware(), ["ssd", "swap", "checkpoint", "keep"])
    # Block 2's backward (recomputed): outside 50 + its own 100 + its parameters' private copy
    # 1,024 + blocks 1 and 0 prefetched 200 (block 3's, 360 without the copy, is lower).
    assert cost.peak_bytes == 1374
    assert cost.host_bytes == 100 and cost.ssd_bytes == 100
    assert cost.backward_extra_s >= 1.0  # the checkpointed block's recomputation at least


def test_bad_modes_and_an_unmeasured_disk_are_refused() -> None:
    with pytest.raises(ValueError, match="3 block modes for a model of 4 blocks"):
        activation_cost(model(), hardware(), ["keep"] * 3)
    with pytest.raises(ValueError, match="unknown block modes"):
        activation_cost(model(), hardware(), ["keep", "keep", "keep", "nvme"])
    with pytest.raises(ValueError, match="ssd.path"):
        activation_cost(model(), hardware(ssd_write_bytes_per_s=0.0), ["ssd"] * 4)


def test_the_search_predicts_the_block_modes_it_is_given() -> None:
    profile, hw = model(), hardware()
    kept = search(profile, hw, device_budget=1 << 30, host_budget=1 << 30)
    modes = ["ssd", "swap", "checkpoint", "keep"]
    moved = search(profile, hw, device_budget=1 << 30, host_budget=1 << 30, block_modes=modes)
    cost = activation_cost(profile, hw, modes)
    assert moved.best.prediction.activation_bytes == cost.peak_bytes
    assert kept.best.prediction.activation_bytes == profile.activation_bytes
    assert moved.best.prediction.ssd_bytes == 100
    # The same chunk plan, plus the modes' exposed time.
    same = predict(
        profile,
        hw,
        chunk_costs(profile, hw, moved.best.chunk_size),
        n_persist=moved.best.n_persist,
        n_buffer=moved.best.n_buffer,
    )
    extra = cost.forward_extra_s + cost.backward_extra_s
    assert moved.best.prediction.step_s == pytest.approx(same.step_s + extra)

"""The planner and the NVMe tier of optimizer state (issue 31): the search moves chunks' state to
NVMe only where host memory binds, as few as make the fastest plan fit (or let a faster
activation layout fit in the RAM they free), counts the disk's reads and writes, keeps within
the disk's room, prefers plans that write less when a write limit is set, and the what-if
answers with a hardware file's drive: a 7B full fine-tune on a 24 GiB GPU with 64 GB of RAM, and
models twice as large on an A100 with a 4 TB drive."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from protrain.launcher.cli import main
from protrain.launcher.what_if_cli import parse_what_if
from protrain.profiler.activation_cost import activation_options
from protrain.profiler.analytic import KNOWN_CONFIGS, shape_from_config
from protrain.profiler.cost_model import chunk_costs, nvme_io_bytes, offloaded_host_bytes, predict
from protrain.profiler.nvme_cost import writes_per_day
from protrain.profiler.profile import BlockProfile, ModelProfile
from protrain.profiler.search import Candidate, NoPlanFitsError, search
from protrain.runtime.commands.what_if import family_shape, machine_for, plan_for
from protrain.runtime.config.hardware_spec import load_hardware
from tests.unit.test_cost_model import MIB, four_blocks, hardware

HARDWARE = Path(__file__).resolve().parents[2] / "configs" / "hardware"
CHUNK = 4 * MIB
"""One block's parameter (1M fp32) per chunk."""
DISK = {
    "ssd_write_bytes_per_s": 2e10,
    "ssd_read_bytes_per_s": 3e10,
    "copies_overlap_compute": True,
    "h2d_bytes_per_s": 2e10,
    "d2h_bytes_per_s": 2e10,
}


def blocks(count: int, *, activation: int = 10 * MIB, forward_s: float = 1e-3) -> ModelProfile:
    """``count`` blocks of one fp32 parameter of 1M elements each (a chunk each), backward twice
    the forward."""
    one = four_blocks(activation=activation)
    block = BlockProfile(forward_s=forward_s, backward_s=2 * forward_s, activation_bytes=activation, input_bytes=MIB)
    return dataclasses.replace(
        one,
        param_sizes=((1 << 20, True),) * count,
        param_block=tuple(range(count)),
        module_params=tuple((index,) for index in range(count)),
        blocks=(block,) * count,
    )


def host_need(model: ModelProfile, *, n_persist: int, n_optimizer: int) -> int:
    costs = chunk_costs(model, hardware(**DISK), CHUNK)
    return offloaded_host_bytes(costs, n_persist, keeps_gradients=False, n_optimizer=n_optimizer)


def nvme_search(model: ModelProfile, host_budget: int, **kwargs: Any) -> Candidate:
    """The best all-offloaded plan at ``CHUNK``, NVMe chunks left to the search unless given."""
    options: dict[str, Any] = {"device_budget": int(100 * MIB), "n_optimizer": None, **kwargs}
    return search(
        model,
        hardware(**DISK),
        host_budget=host_budget,
        chunk_size=CHUNK,
        n_persist=0,
        keeps_gradients=False,
        **options,
    ).best


def test_the_tier_is_used_only_where_host_memory_binds() -> None:
    model = blocks(8)
    roomy = nvme_search(model, host_need(model, n_persist=0, n_optimizer=0))
    assert roomy.n_optimizer == 0 and roomy.prediction.nvme_bytes == 0
    # 12 MiB short: a chunk's state is 8 MiB, but the first three moved each bring a host slot
    # as large: five chunks, not two.
    tight_budget = host_need(model, n_persist=0, n_optimizer=0) - 12 * MIB
    tight = nvme_search(model, tight_budget)
    assert tight.n_optimizer == 5
    assert host_need(model, n_persist=0, n_optimizer=tight.n_optimizer) <= tight_budget
    assert host_need(model, n_persist=0, n_optimizer=tight.n_optimizer - 1) > tight_budget
    assert tight.prediction.nvme_bytes == tight.n_optimizer * 2 * 4 * MIB
    with pytest.raises(NoPlanFitsError, match="host budget"):
        nvme_search(model, tight_budget, n_optimizer=0)


def test_reads_writes_and_their_time() -> None:
    """Every NVMe chunk is written each update; read back only where it shares its host slot:
    two of four. A slow disk shows in the step; a fast one hides behind the updates."""
    costs = chunk_costs(four_blocks(), hardware(**DISK), CHUNK)
    state = 2 * 4 * MIB
    assert nvme_io_bytes(costs, 3) == (0, 3 * state)
    assert nvme_io_bytes(costs, 4) == (2 * state, 4 * state)
    steps = {}
    for rate in (1e12, 1e7):
        hw = hardware(**{**DISK, "ssd_write_bytes_per_s": rate, "ssd_read_bytes_per_s": rate})
        base = predict(four_blocks(), hw, costs, n_persist=0, n_buffer=2, keeps_gradients=False)
        moved = predict(four_blocks(), hw, costs, n_persist=0, n_buffer=2, keeps_gradients=False, n_optimizer=4)
        steps[rate] = moved.step_s - base.step_s
        assert moved.nvme_bytes == 4 * state and moved.nvme_read_bytes == 2 * state
    assert steps[1e12] < 1e-3
    assert steps[1e7] == pytest.approx(6 * state / 1e7 + (2 * state / 4) / 1e7 - base.cpu_adam_s, rel=0.05)
    # Two ranks of the host writing to one drive get half its rate each.
    shared = hardware(**{**DISK, "ssd_write_bytes_per_s": 1e7, "ssd_read_bytes_per_s": 1e7}, ssd_ranks_sharing=2)
    slower = predict(four_blocks(), shared, costs, n_persist=0, n_buffer=2, keeps_gradients=False, n_optimizer=4)
    assert slower.step_s - base.step_s > 1.9 * steps[1e7]


def swap_or_recompute() -> ModelProfile:
    """Eight blocks whose activations (40 MiB each) do not fit the device together: swapped to
    host memory (fast) or recomputed (slow)."""
    return blocks(8, activation=40 * MIB, forward_s=20e-3)


def test_freed_ram_buys_a_faster_activation_layout_unless_the_writes_are_capped() -> None:
    """Host memory holds the model state but not the swapped activations as well: moving chunks'
    state to NVMe lets the swap layout fit, faster than recomputing. With a write limit below
    what that plan writes a day, the planner takes the plan that writes less."""
    model = swap_or_recompute()
    hw = hardware(**DISK)
    layouts = activation_options(model, hw)
    # Six blocks swapped (240 MiB) fit beside the state only with 20 MiB of it moved to NVMe.
    budget = host_need(model, n_persist=0, n_optimizer=0) + 220 * MIB
    device = int(200 * MIB)
    best = nvme_search(model, budget, activation_layouts=layouts, device_budget=device)
    without = nvme_search(model, budget, activation_layouts=layouts, n_optimizer=0, device_budget=device)
    assert best.n_optimizer > 0 and without.n_optimizer == 0
    assert best.prediction.step_s < without.prediction.step_s
    assert (best.block_modes or ()).count("swap") > (without.block_modes or ()).count("swap")
    daily = writes_per_day(best.prediction.nvme_bytes, best.prediction.step_s)
    capped = nvme_search(model, budget, activation_layouts=layouts, max_writes_per_day=daily / 2, device_budget=device)
    assert writes_per_day(capped.prediction.nvme_bytes, capped.prediction.step_s) < daily


def test_the_disk_room_bounds_the_tier() -> None:
    model = blocks(8)
    budget = host_need(model, n_persist=0, n_optimizer=0) - 12 * MIB
    assert nvme_search(model, budget).n_optimizer > 0
    with pytest.raises(NoPlanFitsError):
        nvme_search(model, budget, disk_room=4 * MIB)


def test_a_7b_full_fine_tune_fits_a_24_gib_gpu_with_64_gb_and_a_2_tb_drive() -> None:
    hardware_file = str(HARDWARE / "rtx4090-64gb-nvme.yaml")
    shape = shape_from_config(KNOWN_CONFIGS["llama-2-7b"], name="llama-2-7b")
    for clipping in ([], ["--clipping"]):
        without = parse_what_if(["--what-if", hardware_file, "--model-config", "llama-2-7b", *clipping])
        with pytest.raises(NoPlanFitsError, match="host budget"):
            plan_for(shape, machine_for(without, load_hardware(hardware_file)), without)
        request = parse_what_if(["--what-if", hardware_file, "--model-config", "llama-2-7b", "--ssd", *clipping])
        plan = plan_for(shape, machine_for(request, load_hardware(hardware_file)), request)
        assert plan.n_optimizer > 0 and plan.predicted_nvme_bytes is not None
        assert plan.predicted_peak_host_bytes is not None and plan.predicted_peak_host_bytes <= plan.host_budget_bytes
        assert plan.predicted_nvme_bytes < 2 * 10**12


def test_a_4_tb_drive_beside_1_tb_fits_models_twice_as_large_on_an_a100(capsys: pytest.CaptureFixture[str]) -> None:
    hardware_file = str(HARDWARE / "a100-80gb.yaml")
    gpt_100b = family_shape("gpt-100b", 80, 10240, 80, 1024)
    gpt_175b = family_shape("gpt-175b", 96, 12288, 96, 1024)
    plain = parse_what_if(["--what-if", hardware_file, "--largest"])
    with pytest.raises(NoPlanFitsError, match="host budget"):  # the largest without is at most 75B
        plan_for(gpt_100b, machine_for(plain, load_hardware(hardware_file)), plain)
    request = parse_what_if(["--what-if", hardware_file, "--largest", "--ssd"])
    plan = plan_for(gpt_175b, machine_for(request, load_hardware(hardware_file)), request)
    assert gpt_175b.parameters >= 2 * 75e9 and plan.n_optimizer > 0
    assert plan.predicted_nvme_bytes is not None and plan.predicted_nvme_bytes <= 4 * 10**12
    # The plan table says how much is on the drive and what it writes.
    assert main(["--what-if", str(HARDWARE / "rtx4090-64gb-nvme.yaml"), "--model-config", "llama-2-7b", "--ssd"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "NVMe optimizer state" in out and "per update" in out and "per day" in out


def test_kept_gradients_go_to_files_too() -> None:
    """With gradients kept (clipping, accumulation) an NVMe chunk's gradient is in a file of its
    own: written every update, read back for the update but by the first two chunks it reaches
    (their buffers still hold them); the host keeps two gradient buffers instead of a gradient
    shard per NVMe chunk."""
    costs = chunk_costs(four_blocks(), hardware(**DISK), CHUNK)
    state, grad = 2 * 4 * MIB, 4 * MIB
    assert nvme_io_bytes(costs, 1, keeps_gradients=True) == (0, state + grad)
    assert nvme_io_bytes(costs, 4, keeps_gradients=True) == (2 * state + 2 * grad, 4 * (state + grad))

    def kept_gradient_bytes(n_optimizer: int) -> int:
        kept = offloaded_host_bytes(costs, 0, keeps_gradients=True, n_optimizer=n_optimizer)
        return kept - offloaded_host_bytes(costs, 0, keeps_gradients=False, n_optimizer=n_optimizer)

    staging = kept_gradient_bytes(0) - 4 * grad  # the four shards in RAM; the rest is staging
    assert kept_gradient_bytes(4) == 2 * grad + staging
    assert kept_gradient_bytes(1) == 3 * grad + grad + staging  # three in RAM, one buffer

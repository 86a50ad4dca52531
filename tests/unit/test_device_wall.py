"""The device wall (``PROTRAIN_STRICT_DEVICE=1``, runtime/hw/device_wall.py): on CPU every storage
allocated on the compute device while an engine call runs counts against the engine's budget, as
CUDA's allocator counts it, whoever allocates it; passing the budget raises at once."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch

from protrain import runtime
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo, SideStream
from protrain.runtime.hw.device_wall import Account, DeviceBudgetExceeded
from protrain.runtime.hw.host_memory import MmapArena
from tests.helpers import lm_batches, tiny_gpt, train_updates

CPU = torch.device("cpu")


@pytest.fixture
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(device_wall.ENV, "1")


def account(budget: int = 1 << 30) -> Account:
    opened = device_wall.open_account("engine under test", budget, CPU)
    assert opened is not None
    return opened


def test_storages_count_at_creation_and_leave_when_freed(strict: None) -> None:
    wall = account()
    try:
        with device_wall.engine_call(wall, "test"):
            made = torch.empty(1000)  # 4,000 bytes
            assert wall.live_bytes == 4000
            view = made[10:20].view(2, 5)
            made.add_(1.0)
            torch.mul(made, 2.0, out=made)
            made.detach()
            assert wall.live_bytes == 4000, "views, in-place and out= ops allocate nothing"
            del made
            gc.collect()
            assert wall.live_bytes == 4000, "a view keeps its storage alive"
            del view
            assert wall.live_bytes == 0 and wall.take_highest() == 4000
            twice = torch.ones(10) + torch.ones(10)  # two temporaries freed, the sum kept
            assert wall.live_bytes == 40 and wall.take_highest() == 120
        outside = torch.empty(1000)  # no engine call: the caller's own tensors are not counted
        assert wall.live_bytes == 40
        del twice, outside
        assert wall.live_bytes == 0
    finally:
        device_wall.close_account(wall)


def test_host_regions_and_host_allocations_do_not_count(strict: None) -> None:
    wall = account()
    arena = MmapArena(1 << 20)
    try:
        with device_wall.engine_call(wall, "test"):
            carved = arena.allocate(1000, torch.float32)
            carved.fill_(1.0)
            with device_wall.host_allocations():
                staging = torch.empty(1000)
            assert wall.live_bytes == 0
            on_device = carved * 2
            assert wall.live_bytes == 4000
        del carved, staging, on_device
    finally:
        arena.close()
        device_wall.close_account(wall)


def test_side_stream_jobs_count_to_the_engine_that_made_the_stream(strict: None) -> None:
    wall = account()
    kept: list[torch.Tensor] = []
    try:
        with device_wall.engine_call(wall, "test"):
            stream = SideStream(DeviceInfo(CPU, "gloo"))
        # The job runs on the stream's thread, after the call that made it returned.
        stream.submit(lambda: kept.append(torch.empty(256))).wait()
        assert wall.live_bytes == 1024
        stream.close()
    finally:
        device_wall.close_account(wall)


def test_passing_the_budget_raises_at_once_naming_the_operation(strict: None) -> None:
    wall = account(budget=10_000)
    try:
        with device_wall.engine_call(wall, "engine.export"):
            first = torch.empty(2000)
            with pytest.raises(DeviceBudgetExceeded) as raised:
                torch.empty(2000)
        message = str(raised.value)
        assert "engine.export" in message and "aten.empty" in message
        assert "8,000 bytes" in message and "16,000 bytes" in message and "10,000 bytes" in message
        assert isinstance(raised.value, torch.OutOfMemoryError), "handled as CUDA's out-of-memory error is"
        assert wall.live_bytes == 8000, "the refused tensor was freed"
        del first
    finally:
        device_wall.close_account(wall)


def test_off_by_default_nothing_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(device_wall.ENV, raising=False)
    assert device_wall.open_account("engine", 1, CPU) is None
    with device_wall.engine_call(None, "test"):
        torch.empty(1000)  # no wall: a budget of one byte is not enforced


def test_a_forward_hook_allocating_twice_the_budget_stops_at_the_wall(strict: None, tmp_path: Path) -> None:
    """The wall is real: what a hook allocates inside the engine's forward counts like the
    engine's own memory, and the error names the call, the bytes and the budget."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    model = tiny_gpt()
    config = {
        "micro_batch_size": 2,
        "memory": {"device_budget": "4MiB"},
        "output_dir": str(tmp_path / "runs"),
        "profiler": {"cache_dir": str(tmp_path / "cache")},
    }
    with runtime.initialize(model, config=config, example_batch=data.batch(0, 0, 0)) as engine:
        train_updates(engine, data, range(2))  # the plan fits its budget
        budget = engine.plan.device_budget_bytes
        handle = model.register_forward_hook(lambda *_: torch.empty(2 * budget // 4))
        with pytest.raises(DeviceBudgetExceeded, match=rf"engine\.forward .* over its memory\.device_budget of {budget:,} bytes"):
            engine(**data.batch(2, 0, 0))
        handle.remove()
        train_updates(engine, data, range(2, 3))  # nothing of the refused forward stays counted


def test_each_thread_counts_to_its_own_engine(strict: None) -> None:
    first, second = account(), account()
    try:
        made: dict[str, torch.Tensor] = {}

        def run(wall: Account, name: str, numel: int) -> None:
            with device_wall.engine_call(wall, name):
                made[name] = torch.empty(numel)

        threads = [
            threading.Thread(target=run, args=(first, "a", 100)),
            threading.Thread(target=run, args=(second, "b", 300)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert (first.live_bytes, second.live_bytes) == (400, 1200)
    finally:
        device_wall.close_account(first)
        device_wall.close_account(second)


def test_what_a_closed_engine_left_alive_counts_against_the_next(strict: None) -> None:
    """CUDA's cap is the live engines' budgets together, over everything its allocator holds: a
    storage a closed engine left alive still takes the device. On CPU it still counts, and the
    error says so."""
    gc.collect()  # what earlier tests' engines left in reference cycles
    first = account(budget=10_000)
    with device_wall.engine_call(first, "the first engine's training"):
        left = torch.empty(1500)  # 6,000 bytes
    device_wall.close_account(first)
    second = account(budget=10_000)
    try:
        with device_wall.engine_call(second, "the second engine's training"):
            kept = torch.empty(1000)  # 4,000 bytes of its own: 10,000 on the device
            with pytest.raises(DeviceBudgetExceeded, match="6,000 bytes are still held by closed engines"):
                torch.empty(1)
            del left
            more = torch.empty(1000)  # what the first engine held is gone: room again
        assert second.live_bytes == 8000
        del kept, more
    finally:
        device_wall.close_account(second)


def test_a_closed_engine_gives_its_device_memory_back_while_still_referenced(
    strict: None, tmp_path: Path
) -> None:
    """Engines one after another in a process (a save then a resume, train then evaluate): the
    first is closed but still referenced (a ``with`` block's name, a result holding it). Its chunks,
    optimizer state and buffers leave the device at close, so the second fits the same budget;
    its parameters then say their engine was closed (an H100 run's second engine ran out of
    memory beside the first's whole device state)."""
    from protrain.runtime.chunks.released import ReleasedParameterError

    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    budget = 11 << 18  # 2.75 MiB
    config = {
        "micro_batch_size": 2,
        "memory": {"device_budget": budget, "chunk_size": "64KiB", "n_persist": 8, "n_buffer": 2},
        "output_dir": str(tmp_path / "runs"),
        "profiler": {"cache_dir": str(tmp_path / "cache")},
    }
    gc.collect()
    first_model = tiny_gpt()
    with runtime.initialize(first_model, config=config) as first:
        train_updates(first, data, range(2))
        held = first._state.claim.wall
        # The second engine's peak will be the first's: with what the first holds now, too much.
        assert held is not None and held.highest + held.live_bytes > budget
    gc.disable()  # as a reference cycle would keep it: nothing is collected meanwhile
    try:
        assert held.live_bytes <= 64, f"{held.live_bytes:,} bytes still on the device after close"
        with runtime.initialize(tiny_gpt(), config=config) as second:
            train_updates(second, data, range(2))
    finally:
        gc.enable()
    with pytest.raises(ReleasedParameterError, match="its engine was closed"):
        first_model.wte.weight.sum()
    assert first is not None


def test_an_engine_dropped_in_a_reference_cycle_gives_the_next_its_device_memory(
    strict: None, tmp_path: Path
) -> None:
    """A sweep's first engine ended inside an exception (its traceback holding the forward's
    activations, a cycle the collector alone frees). Neither CUDA's allocator nor a full device
    runs Python's collector: the next engine does, before it claims the device, so it trains in
    the same budget as the first (CI once failed here, engines' leftovers counting against a
    test's tiny budget)."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    config = {
        "micro_batch_size": 2,
        "memory": {"device_budget": 11 << 18, "chunk_size": "64KiB", "n_persist": 8, "n_buffer": 2},
        "output_dir": str(tmp_path / "runs"),
        "profiler": {"cache_dir": str(tmp_path / "cache")},
    }
    gc.collect()
    gc.disable()  # nothing collected but what the engines collect
    try:
        first = runtime.initialize(tiny_gpt(), config=config)
        held = first._state.claim.wall
        trap: list[object] = []
        try:
            out = first(**data.batch(0, 0, 0))
            raise RuntimeError("the loss was NaN")
        except RuntimeError as err:
            trap.extend([err, trap, out])  # the traceback holds the forward's frames, the cycle the error
        del out, first, trap
        assert held is not None and held.live_bytes > 0, "the forward left nothing alive: no test"
        with runtime.initialize(tiny_gpt(), config=config) as second:
            assert held.live_bytes == 0, f"{held.live_bytes:,} bytes of the dropped engine still on the device"
            train_updates(second, data, range(2))
    finally:
        gc.enable()

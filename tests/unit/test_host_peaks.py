"""Host memory at the moments a run's state is copied: the caller's model taken over at
``initialize``, a plan switch, a checkpoint. Measured from outside the runtime: the process's
resident set and its high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``), on a
model whose state is large against the interpreter's noise (20M parameters, 240 MB of fp32
master and moments)."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path
from typing import Any

import pytest
import torch

import protrain.runtime.entry  # noqa: F401 - imported before the readings: initialize's imports are not the test's
from protrain import runtime
from protrain_demo.gpt import GPT, GPTConfig
from protrain.runtime.planning import budgets
from tests.helpers import lm_batches, train_updates

MIB = 1 << 20
SLACK = 32 * MIB
"""The process's resident set moves a little between a reading here and initialize's own."""
WIDE = GPTConfig(vocab_size=2048, seq_len=32, n_layer=6, n_head=4, d_model=512)

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/self/status has no {field}")


def settle() -> int:
    """Free what is garbage and hand glibc's free pages back; the resident set then, with the
    high-water mark restarted from it."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def added_peak(before: int) -> int:
    return status_bytes("VmHWM") - before


def job(tmp_path: Path, **memory: Any) -> dict[str, Any]:
    return {
        "seed": 1,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3},
        "memory": memory,
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "profiler": {"cache_dir": str(tmp_path / "cache")},
        "output_dir": str(tmp_path / "runs"),
    }


def parameter_bytes(model: GPT) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_callers_parameters_are_counted_once_the_chunks_take_them_over(tmp_path: Path) -> None:
    """The process at ``initialize`` holds the caller's model; its chunks then hold the
    parameters instead. The plan's fixed host part is the process less those parameters (before,
    they were counted again beside the chunk state: 80 MB twice here, 1.1 GB on a 285M model)."""
    model = GPT(WIDE)
    params = parameter_bytes(model)
    assert params > 2 * SLACK
    before = budgets.process_rss_bytes()
    with runtime.initialize(model, config=job(tmp_path)) as engine:
        fixed = engine.plan.host_fixed_bytes
    assert abs(fixed - (before - params)) < SLACK, f"fixed {fixed:,}, process {before:,}, parameters {params:,}"


def test_a_checkpoint_copies_no_host_state_and_a_plan_switch_holds_one_layout(tmp_path: Path) -> None:
    """Every chunk offloaded (the state lives in host memory). The first batch is profiled and
    the engine switches plans: the old layout's pages go back as the state moves, so the first
    step adds about the new layout's state (1.1x it, the step's own memory included; before,
    both layouts at once: 2.2x). A synchronous
    checkpoint hands the host state to the writer as it is (before: torch's writer cloned every
    view of it and kept the clones until the rank's file was written: 232 MiB here; now under
    1 MiB, the checksums' reads going through one 4 MiB buffer)."""
    model = GPT(WIDE)
    state = parameter_bytes(model) * 3  # fp32 master and two moments
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    engine = runtime.initialize(model, config=job(tmp_path, device_budget=parameter_bytes(model) // 2))
    del model
    try:
        assert engine.plan.n_persist == 0, engine.plan.rule
        before = settle()
        train_updates(engine, data, range(1))  # profiled, searched, switched, trained
        assert engine.plan.rule.startswith("planned on a batch"), engine.plan.rule
        switch = added_peak(before)
        assert switch <= state * 1.4, f"the first step added {switch / MIB:.0f} MiB, the state is {state / MIB:.0f} MiB"
        train_updates(engine, data, range(1, 2))
        before = settle()
        engine.save_checkpoint()
        saved = added_peak(before)
        assert saved <= SLACK, f"a checkpoint added {saved / MIB:.0f} MiB, the state is {state / MIB:.0f} MiB"
    finally:
        engine.close()


def test_building_the_chunks_gives_each_original_up_as_its_chunk_takes_it(tmp_path: Path) -> None:
    """``initialize`` copies the caller's parameters into chunks (here all offloaded: the chunks
    live in host memory). Each parameter's original goes as soon as its chunk holds it, so the
    model and its chunks never coexist whole: initialize's peak is the memory it leaves held
    plus about a chunk (before: plus the whole model and more, 166 MiB over it here; +1.1 GiB
    on a 285M model)."""
    model = GPT(WIDE)
    params = parameter_bytes(model)
    settle()
    engine = runtime.initialize(model, config=job(tmp_path, device_budget=params // 2))
    try:
        assert engine.plan.n_persist == 0, engine.plan.rule
        chunk = engine.plan.chunk_size
        peak = status_bytes("VmHWM")
        held = settle()
        over = peak - held
        assert over <= 2 * chunk + SLACK, (
            f"initialize's peak was {over / MIB:.0f} MiB over what it left held; the parameters are "
            f"{params / MIB:.0f} MiB, a chunk {chunk / MIB:.0f} MiB"
        )
    finally:
        engine.close()


def test_a_checkpoint_moves_device_state_through_one_host_buffer(tmp_path: Path) -> None:
    """Every chunk persistent: the state lives on the device (on CPU, RAM outside the host arena).
    A save hands it to the writer one parameter's piece at a time through one host buffer, and a
    load reads it back the same way, so each adds about the largest parameter, not the state
    (before, a save on a GPU copied all of it to host memory first, 240 MB here, and a load staged
    all of it; on CPU the old path copied nothing, so only the GPU was wrong, which is why the
    CPU device tier now takes the GPU's path). The loaded state trains on as the saved one did."""
    model = GPT(WIDE)
    state = parameter_bytes(model) * 3
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    engine = runtime.initialize(model, config=job(tmp_path, device_budget=state * 3))
    del model
    try:
        assert engine.plan.n_persist == engine.plan.num_chunks, engine.plan.rule
        train_updates(engine, data, range(2))
        before = settle()
        path = engine.save_checkpoint()
        saved = added_peak(before)
        bound = largest + SLACK
        assert saved <= bound, f"a checkpoint added {saved / MIB:.0f} MiB; the largest parameter is {largest / MIB:.0f} MiB"
        train_updates(engine, data, range(2, 3))
        expected = engine.state_dict()
        before = settle()
        engine.load_checkpoint(path)
        loaded = added_peak(before)
        assert loaded <= bound, f"a load added {loaded / MIB:.0f} MiB; the largest parameter is {largest / MIB:.0f} MiB"
        train_updates(engine, data, range(2, 3))
        for name, tensor in engine.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
    finally:
        engine.close()

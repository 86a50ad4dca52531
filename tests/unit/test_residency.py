"""Residency claims checked from outside the runtime's own bookkeeping (DESIGN section 6):
addresses of the parameters each module reads, the number of distinct buffer storages in use,
and the C heap (the CPU device tier) measured with glibc's mallinfo2 while the host tier lives
in an mmap arena that malloc does not see."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from protrain import runtime
from protrain_demo.corpus import LMBatches
from protrain.runtime.hw.device import malloc_in_use_bytes
from tests.helpers import lm_batches, tiny_gpt

N_PERSIST, N_BUFFER = 2, 2


def address_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


def inside(pointer: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= pointer < end for start, end in ranges)


def warm_up_torch(data: LMBatches) -> None:
    """Let torch make its one-off allocations (kernel workspaces, thread pools, the autograd
    engine) before the baseline, so the heap measures our tiers and not library start-up."""
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    for update in range(2):
        model(**data.batch(update, 0, 0)).loss.backward()
        optimizer.step()
    del model, optimizer


def run_and_measure(
    tmp_path: Path, data: LMBatches, n_persist: int | str, n_buffer: int
) -> tuple[int, list[str], Any]:
    """Train 3 steps; return the peak heap growth sampled at every module hook, the problems
    found, and the engine (closed)."""
    gc.collect()
    baseline = malloc_in_use_bytes()
    model = tiny_gpt()
    config = {
        "seed": 1,
        "micro_batch_size": 2,
        "output_dir": str(tmp_path / "runs"),
        "memory": {
            "chunk_size": "64KiB",
            "n_persist": n_persist,
            "n_buffer": n_buffer,
            "device_budget": "6MiB",
        },
    }
    engine = runtime.initialize(model, config=config)
    # The pool and the persistent chunks, as the test sees them: plain address ranges.
    pool = address_ranges(engine.chunks.slots)
    persistent = address_ranges([c.full for c in engine.chunks.chunks if c.persistent])
    problems: list[str] = []
    peak = [0]

    def check_forward(module: nn.Module, *_: object) -> None:
        check_pool()
        for name, param in module.named_parameters(recurse=False):
            if not (inside(param.data_ptr(), pool) or inside(param.data_ptr(), persistent)):
                problems.append(f"{type(module).__name__}.{name} reads outside the device pool")
            if param.untyped_storage().nbytes() <= param.element_size():
                problems.append(f"{type(module).__name__}.{name} is evicted while its module runs")

    def check_pool(*_: object) -> None:
        # Backward reads weights through saved tensors, re-gathered on demand, so only the
        # pool bound applies there (a bias's chunk may well be gone by then).
        peak[0] = max(peak[0], malloc_in_use_bytes() - baseline)
        live_offloaded = {
            p.untyped_storage().data_ptr()
            for p in model.parameters()
            if p.untyped_storage().nbytes() > p.element_size() and not inside(p.data_ptr(), persistent)
        }
        if len(live_offloaded) > n_buffer:
            problems.append(f"{len(live_offloaded)} buffer storages hold parameters (n_buffer={n_buffer})")

    handles = []
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            handles.append(module.register_forward_pre_hook(check_forward))
            handles.append(module.register_forward_hook(check_forward))
            handles.append(module.register_full_backward_hook(check_pool))
    for update in range(3):
        engine.backward(engine(**data.batch(update, 0, 0)).loss)
        engine.step()
        check_pool()
    for handle in handles:
        handle.remove()
    engine.close()
    return peak[0], problems, engine


# The embedding's inputs need no gradient; torch warns that its backward hook sees outputs only.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_parameters_live_in_the_pool_and_the_device_tier_stays_in_budget(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    warm_up_torch(data)
    resident_peak, resident_problems, resident = run_and_measure(tmp_path, data, "auto", 0)
    peak, problems, engine = run_and_measure(tmp_path, data, N_PERSIST, N_BUFFER)
    assert resident.plan.n_persist == resident.plan.num_chunks == 12
    assert not resident_problems and not problems, (resident_problems + problems)[:5]
    # The offloaded chunks' fp32 state (master and two moments: no clipping or accumulation, so
    # no gradient shard) sits in the host arena, for their real elements.
    arena = engine.chunks.host_arena
    real = sum(info.used for info in engine.chunks.layout.chunks[N_PERSIST:])
    assert arena is not None and arena.used_bytes >= real * 3 * 4
    # Device tier, measured by malloc: within the plan's budget, and 10 of 12 chunks' state
    # (16 bytes per real parameter: a persistent chunk holds no padding) smaller than when
    # everything stays resident.
    assert 0 < peak <= engine.plan.device_budget_bytes, f"peak {peak / 2**20:.2f} MiB"
    saved = resident_peak - peak
    offloaded_state = real * 16
    assert saved >= 0.5 * offloaded_state, f"saved {saved / 2**20:.2f} MiB of {offloaded_state / 2**20:.2f}"

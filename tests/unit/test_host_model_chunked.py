"""A model held whole in host memory whose state is twice the device budget is chunked, not
moved whole and not refused: chunks are built from the host tensors (persistent ones uploaded one
by one), and the device tier (the C heap on CPU, measured with mallinfo2 from outside the
runtime's bookkeeping; the host tier lives in an mmap arena malloc does not see) never exceeds
the plan's predicted peak, from ``initialize`` through the first updates.

Two ways in: as on the CPU (the parameters already are on the device, so the model is profiled
whole) and as on a GPU (the parameters are away from the device: first-use order is recorded on
stand-ins and the model is profiled through its chunks), the latter forced on CPU by saying the
parameters are not on the device."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import protrain.runtime.entry  # noqa: F401 - the engine's modules load before the heap is measured
from protrain import runtime
from protrain.runtime.chunks import store, store_build
from protrain.runtime.hw.device import malloc_in_use_bytes
from protrain.runtime.planning.profilers import Profilers
from tests.helpers import TINY_GPT, assert_state_equal, lm_batches, tiny_gpt, train_reference, train_updates
from tests.unit.test_planning import job
from tests.unit.test_residency import warm_up_torch

STEPS = 3
WIDE = dataclasses.replace(TINY_GPT, d_model=128)
"""Twice the tiny GPT's width: model state (6.6 MiB) outweighs a batch's activations."""


class DeviceTier:
    """The heap's growth above a baseline, sampled at hooks; its highest reading."""

    def __init__(self) -> None:
        gc.collect()
        self.baseline = malloc_in_use_bytes()
        self.highest = 0
        self.samples = 0

    def sample(self, *_: object) -> None:
        self.samples += 1
        self.highest = max(self.highest, malloc_in_use_bytes() - self.baseline)


def sampled_everywhere(model: nn.Module, tier: DeviceTier) -> list[Any]:
    """Readings before and after every module's forward (those of initialize's own forwards
    too: first-use order, profiling) and at every module's backward."""
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(tier.sample))
        handles.append(module.register_forward_hook(tier.sample))
        if any(True for _ in module.parameters(recurse=False)):  # the root returns no tensor
            handles.append(module.register_full_backward_hook(tier.sample))
    return handles


@pytest.fixture
def whole_moves(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[nn.Module], list[str]]]:
    """Spy on the calls that move a module whole (``to``, ``cuda``, and ``_apply`` under them):
    the test asks which were made on its model."""
    calls: list[tuple[int, str]] = []
    for name in ("to", "cuda", "_apply"):
        original = getattr(nn.Module, name)

        def spy(self: nn.Module, *args: Any, _call: Any = original, _name: str = name, **kwargs: Any) -> Any:
            calls.append((id(self), _name))
            return _call(self, *args, **kwargs)

        monkeypatch.setattr(nn.Module, name, spy)
    yield lambda model: [name for target, name in calls if target == id(model)]


# The embedding's inputs need no gradient; torch warns that its backward hook sees outputs only.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("on_device", [True, False], ids=["held-on-the-device", "held-away-as-on-a-gpu"])
def test_a_model_twice_the_device_budget_is_chunked_within_the_predicted_peak(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    whole_moves: Callable[[nn.Module], list[str]],
    on_device: bool,
) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(0, WIDE), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    warm_up_torch(data)
    # Held away, the model sits in host memory as on a GPU: profiled through its chunks.
    measuring = Profilers() if on_device else Profilers(holds_model=lambda model, device: False)
    model = tiny_gpt(0, WIDE)
    budget = 8 * sum(p.numel() for p in model.parameters())  # half the state: 16 bytes a parameter
    tier = DeviceTier()  # the model's own parameters are in the baseline
    handles = sampled_everywhere(model, tier)
    # One reading after each chunk is built: persistent chunks reach the device one at a time.
    build = store_build._ChunkBuilder.build

    def build_and_sample(self: store_build._ChunkBuilder, *args: Any, **kwargs: Any) -> store.Chunk:
        chunk = build(self, *args, **kwargs)
        tier.sample()
        return chunk

    monkeypatch.setattr(store_build._ChunkBuilder, "build", build_and_sample)
    engine = runtime.initialize(
        model,
        config=job(tmp_path, chunk_size="256KiB", device_budget=budget, n_swap=0, n_checkpoint=0),
        example_batch=data.batch(0, 0, 0),
        profilers=measuring,
    )
    tier.sample()
    train_updates(engine, data, range(STEPS))
    tier.sample()
    for handle in handles:
        handle.remove()
    plan = engine.plan
    assert whole_moves(model) == []
    assert plan.rule.startswith("planned on a batch through the chunk engine") != on_device, plan.rule
    assert plan.n_persist < plan.num_chunks, "some chunks live in host memory"
    assert all(p.device == engine.device_info.device for p in model.parameters())
    assert plan.predicted_peak_device_bytes is not None and plan.predicted_peak_device_bytes <= budget
    assert tier.samples > 100
    assert 0 < tier.highest <= plan.predicted_peak_device_bytes, (
        f"device tier rose {tier.highest / 2**20:.3f} MiB above the built model, the plan predicted "
        f"{plan.predicted_peak_device_bytes / 2**20:.3f} MiB"
    )
    assert_state_equal(engine.state_dict(), expected)
    engine.close()


def test_stand_ins_swap_the_data_and_put_it_back() -> None:
    """The forward that records first-use order on a GPU runs on stand-ins (no memory, NaN on
    a stray read); afterwards every parameter holds its own host data again, ties kept."""
    from protrain.runtime.model_io.weights import stand_ins

    model = tiny_gpt()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    with stand_ins(model, torch.device("cpu")):
        assert all(p.untyped_storage().nbytes() == p.element_size() for p in model.parameters())
        assert torch.isnan(model.wte.weight).all()
    assert model.lm_head.weight is model.wte.weight
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    assert_state_equal(dict(model.named_parameters()), before)

"""Profiling a model whose state does not fit the device: the profiling steps run through the
chunk engine (chunks gathered into the buffer pool as training gathers them), measure what
profiling the whole model measures, change nothing, and the searched plan takes over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.profiler.plan import BlockMode
from protrain.profiler.profile import ModelProfile
from protrain.runtime.data.batches import call_model
from protrain.runtime.blocks import find_blocks
from protrain.runtime.chunks.residency_states import Residency
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.planning.model_profiling import ChunkedRun
from protrain.runtime.planning.replanner import chunked_run
from protrain.runtime.training.engine import Engine
from tests.helpers import assert_state_equal, lm_batches, tiny_gpt, train_reference, train_updates
from tests.unit.test_planning import fp32_profile, job

STEPS = 4


def profile(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], chunked: ChunkedRun | None
) -> ModelProfile:
    """One warm-up and one measured step on ``batch``, the blocks found as the planner finds them."""
    path, _ = find_blocks(model, None)
    shape = tuple(batch["input_ids"].shape)
    return fp32_profile(
        model,
        lambda: call_model(model, batch),
        batch_shape=shape,
        block_path=path,
        profile_steps=1,
        chunked=chunked,
    )


def offloaded_engine(tmp_path: Path, **memory: Any) -> Engine:
    """Every chunk in host memory, two device buffers: the model is never whole on the device."""
    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, n_persist=0, n_buffer=2, **memory))
    assert all(not chunk.persistent for chunk in engine.chunks.chunks)
    return engine


def test_profiling_through_the_chunks_measures_what_the_whole_model_shows(tmp_path: Path) -> None:
    """Saved bytes per block (chunk memory excluded), block inputs and the parts outside the
    blocks: the same numbers as profiling the model held whole; the steps really went through
    the buffer pool (gathers counted), and no more than n_buffer chunks were ever resident."""
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)
    whole = profile(tiny_gpt(), batch, None)
    engine = offloaded_engine(tmp_path)
    chunks = engine.chunks
    most_resident = [0]

    def count_resident(*_: Any) -> None:
        resident = sum(c.residency is not Residency.HOST for c in chunks.chunks)
        most_resident[0] = max(most_resident[0], resident)

    handles = [m.register_forward_hook(count_resident) for m in engine.module.modules()]
    gathers = chunks.num_gathers
    with chunks.profiling():
        through = profile(engine.module, batch, chunked_run(chunks))
    for handle in handles:
        handle.remove()
    assert chunks.num_gathers - gathers >= 2 * chunks.layout.num_chunks  # every chunk, every step
    assert 0 < most_resident[0] <= chunks.n_buffer
    assert [b.activation_bytes for b in through.blocks] == [b.activation_bytes for b in whole.blocks]
    assert [b.input_bytes for b in through.blocks] == [b.input_bytes for b in whole.blocks]
    assert through.other_activation_bytes == whole.other_activation_bytes
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in through.blocks)
    assert chunks.stall_s > 0  # waits for gathers were seen, and kept off the block times
    engine.close()


def test_profiling_steps_change_nothing(tmp_path: Path) -> None:
    """No update, no gradient left behind, the random stream where it was: training afterwards
    equals plain PyTorch from the same start."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    engine = offloaded_engine(tmp_path)
    before = engine.state_dict()
    rng = torch.get_rng_state()
    with engine.chunks.profiling():
        profile(engine.module, data.batch(0, 0, 0), chunked_run(engine.chunks))
    assert torch.equal(torch.get_rng_state(), rng)
    assert_state_equal(engine.state_dict(), before)
    kept = [c for c in engine.chunks.trainable_chunks() if c.keeps_gradient]
    assert all(float(c.grad_shard.abs().sum()) == 0 for c in kept)
    train_updates(engine, data, range(STEPS))
    assert_state_equal(engine.state_dict(), expected)
    engine.close()


def model_state_bytes(model: torch.nn.Module) -> int:
    """fp32 parameters, gradients and two Adam moments: what keeping it all on the device takes."""
    return 16 * sum(p.numel() for p in model.parameters())


def test_a_model_larger_than_the_device_is_planned_on_its_first_batch(tmp_path: Path) -> None:
    """The device budget is below the model state, there is no example batch: the engine starts
    with every chunk offloaded (the conservative rule), profiles the first batch through its
    chunks, searches, and switches; the run equals plain PyTorch."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    budget = model_state_bytes(tiny_gpt()) * 2 // 3  # below the state; above the smallest plan
    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, device_budget=budget))
    assert engine.plan.rule.startswith("conservative") and engine.plan.n_persist == 0
    train_updates(engine, data, range(1))  # profiled, planned and switched here
    plan = engine.plan
    assert plan.rule.startswith("planned on a batch through the chunk engine: search"), plan.rule
    assert plan.predicted_peak_device_bytes is not None
    assert plan.predicted_peak_device_bytes <= budget
    assert plan.n_persist < plan.num_chunks  # still larger than the device
    train_updates(engine, data, range(1, STEPS))
    assert_state_equal(engine.state_dict(), expected)
    engine.close()


def test_a_streamed_model_is_planned_on_the_example_batch_through_its_chunks(tmp_path: Path) -> None:
    """Built on the meta device with weights streamed into chunks, it is never whole anywhere:
    initialize profiles the example batch through the chunks and starts under the searched plan;
    a hand-set block mode stays (the profile still sees every block's saved bytes)."""
    from accelerate import init_empty_weights

    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(seed=5), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    with init_empty_weights():
        empty = tiny_gpt(seed=0)
    budget = model_state_bytes(tiny_gpt()) * 2 // 3  # below the state; above the smallest plan
    engine = runtime.initialize(
        empty,
        config=job(tmp_path, device_budget=budget, n_checkpoint=1),
        weights=tiny_gpt(seed=5).state_dict(),
        example_batch=data.batch(0, 0, 0),
    )
    assert engine.module.lm_head.weight is engine.module.wte.weight  # tied again after streaming
    plan = engine.plan
    assert plan.rule.startswith("planned on a batch through the chunk engine: search"), plan.rule
    assert plan.block_modes.count(BlockMode.CHECKPOINT) == 1
    assert plan.predicted_peak_device_bytes is not None and plan.predicted_peak_device_bytes <= budget
    profiled = sorted((tmp_path / "cache").glob("model-*.json"))
    assert len(profiled) == 1
    blocks = ModelProfile.from_dict(json.loads(profiled[0].read_text())).blocks
    assert len({b.activation_bytes for b in blocks}) == 1 and blocks[0].activation_bytes > 0
    train_updates(engine, data, range(STEPS))
    assert_state_equal(engine.state_dict(), expected)
    engine.close()


def test_profiling_with_the_fewest_buffers_a_plan_allows(tmp_path: Path) -> None:
    """One buffer for chunks as large as a block's weights: the chunk the forward ended on must
    be free to leave its slot in backward while profiling, as in training."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    config = job(tmp_path, chunk_size="256KiB", n_persist=0, n_buffer=1)
    engine = runtime.initialize(tiny_gpt(), config=config)
    assert engine.chunks.n_buffer == 1 and engine.chunks.layout.num_chunks > 1
    train_updates(engine, data, range(STEPS))
    assert engine.plan.rule.startswith("planned on a batch through the chunk engine"), engine.plan.rule
    assert_state_equal(engine.state_dict(), expected)
    engine.close()


def test_a_batch_that_does_not_fit_beside_the_resident_chunks_is_profiled_with_them_offloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model state fits the budget (the resident rule keeps every chunk on the device) but a
    step beside it does not: profiling the first batch runs out of memory under the wall, as it
    would on a GPU; the engine offloads every chunk, profiles again and switches to the searched
    plan; the run equals plain PyTorch."""
    monkeypatch.setenv("PROTRAIN_STRICT_DEVICE", "1")
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    budget = model_state_bytes(tiny_gpt()) * 11 // 10  # the state and a tenth: a step needs more
    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, device_budget=budget))
    assert engine.plan.rule.startswith("resident") and engine.plan.n_persist == engine.plan.num_chunks
    train_updates(engine, data, range(STEPS))
    assert "profiling on a batch did not fit beside the persistent chunks" in capsys.readouterr().out
    assert engine.plan.rule.startswith("planned on a batch through the chunk engine: search"), engine.plan.rule
    assert engine.plan.n_persist < engine.plan.num_chunks
    assert_state_equal(engine.state_dict(), expected)
    engine.close()


def test_a_step_that_does_not_fit_even_with_every_chunk_offloaded_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROTRAIN_STRICT_DEVICE", "1")
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with pytest.raises(SpecError) as refused:
        runtime.initialize(tiny_gpt(), config=job(tmp_path, device_budget="300KiB"), example_batch=data.batch(0, 0, 0))
    text = str(refused.value)
    assert text.startswith("memory: no plan fits the device budget of 0.29 MiB per rank: a profiling step with every chunk offloaded"), text
    assert "DeviceBudgetExceeded" in text or "over its memory.device_budget" in text

"""The chunk engine on one rank: offloaded chunks passing through few buffers give the same
training as plain PyTorch, a saved view of a parameter never reads another chunk's data after its
buffer is reused, and knobs that cannot work are refused before training."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.profiler.plan import UpdateMode
from protrain.runtime.chunks.released import ReleasedParameterError
from protrain.runtime.chunks.residency_states import IllegalTransition, Residency, check_move
from protrain.runtime.config.settings import planning_settings_from_spec
from protrain.runtime.config.spec_io import SpecError, validate_spec
from tests.helpers import (
    assert_matches_reference,
    assert_state_close,
    assert_state_equal,
    gpt_reference,
    lm_batches,
    tiny_gpt,
    train_reference,
)

STEPS = 12
CHUNK = "64KiB"  # the tiny GPT (~120K fp32 parameters) in 12 chunks


def job(tmp_path: Path, **memory: Any) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"chunk_size": CHUNK, **memory},
        "output_dir": str(tmp_path / "runs"),
    }


def train(engine: Any, steps: int, accumulation: int = 1) -> list[float]:
    data = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=1)
    losses = []
    for update in range(steps):
        for micro in range(accumulation):
            out = engine(**data.batch(update, micro, 0))
            engine.backward(out.loss)
            engine.step()
        losses.append(out.loss.item())
    return losses


NUM_CHUNKS = 12


@pytest.mark.parametrize(("n_persist", "n_buffer"), [(0, 2), (5, 2), (0, 4), (NUM_CHUNKS, 0)])
def test_offloaded_chunks_train_exactly_like_plain_pytorch(
    tmp_path: Path, n_persist: int, n_buffer: int
) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, n_persist=n_persist, n_buffer=n_buffer))
    assert engine.plan.num_chunks == NUM_CHUNKS
    train(engine, STEPS)
    assert_state_equal(engine.state_dict(), expected)
    if n_persist < NUM_CHUNKS:
        assert engine.chunks.num_gathers > STEPS * (NUM_CHUNKS - n_persist), "slots must have been reused"
        # Offloaded chunks were updated during backward (unclipped: nothing to wait for).
        assert engine.chunks.num_speculations == STEPS * (NUM_CHUNKS - n_persist)
    engine.close()


@pytest.mark.parametrize("n_persist", [0, 5], ids=["all-offloaded", "some-persistent"])
def test_a_bare_backward_is_refused_and_leaves_nothing_behind(tmp_path: Path, n_persist: int) -> None:
    """Unclipped, unaccumulated offloaded chunks keep no gradient shard: a loss.backward() outside
    engine.backward has nowhere to go, so it is refused at its first gradient, and training on
    through engine.backward equals plain PyTorch (no stale gradient, count or buffer left)."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=3, lr=1e-3, weight_decay=0.1)
    with runtime.initialize(tiny_gpt(), config=job(tmp_path, n_persist=n_persist, n_buffer=2)) as engine:
        assert engine.chunks.applies_on_arrival
        with pytest.raises(RuntimeError, match=r"outside engine\.backward.*call engine\.backward\(loss\)"):
            engine(**data.batch(0, 0, 0)).loss.backward()
        train(engine, 3)
        assert_state_equal(engine.state_dict(), expected)


def test_accumulation_with_offload_matches(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=4, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=6, lr=1e-3, weight_decay=0.1)
    config = job(tmp_path, n_persist=2, n_buffer=2)
    config["gradient_accumulation_steps"] = 4
    engine = runtime.initialize(tiny_gpt(), config=config)
    train(engine, 6, accumulation=4)
    assert_state_close(engine.state_dict(), expected)
    engine.close()


class TransposedLinear(torch.nn.Module):
    """Computes x @ w.t() itself, so autograd saves the view w.t() of chunk memory."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.t())


def test_saved_weight_view_survives_slot_reuse(tmp_path: Path) -> None:
    """With one buffer, every later chunk overwrites the slot before backward; the gradient of
    the input must still use each layer's own weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[TransposedLinear(16) for _ in range(4)])
    reference = [layer.weight.detach().clone() for layer in model]
    engine = runtime.initialize(model, config=job(tmp_path, chunk_size=16 * 16 * 4, n_persist=0, n_buffer=1))
    assert engine.plan.num_chunks == 4
    x = torch.randn(3, 16, requires_grad=True)
    loss = engine(x).square().mean()
    gathers_after_forward = engine.chunks.num_gathers
    assert gathers_after_forward == 4 and engine.chunks.resident_chunks() == [3]
    engine.backward(loss)
    assert engine.chunks.num_gathers == 4 + 3, "backward re-gathers chunks 2, 1, 0 into the one slot"

    x_ref = x.detach().clone().requires_grad_(True)
    h = x_ref
    for weight in reference:
        h = torch.tanh(h @ weight.t())
    h.square().mean().backward()
    assert torch.equal(x.grad, x_ref.grad)
    engine.close()


def test_residency_moves_are_checked() -> None:
    assert check_move(0, Residency.HOST, Residency.FETCHING) is Residency.FETCHING
    assert check_move(0, Residency.FETCHING, Residency.RESIDENT) is Residency.RESIDENT
    with pytest.raises(IllegalTransition, match="chunk 2: fetching -> host"):
        check_move(2, Residency.FETCHING, Residency.HOST)
    with pytest.raises(IllegalTransition, match="chunk 3: host -> host"):
        check_move(3, Residency.HOST, Residency.HOST)
    with pytest.raises(IllegalTransition, match="persistent -> host"):
        check_move(1, Residency.PERSISTENT, Residency.HOST)


def test_evicted_parameters_hold_no_data(tmp_path: Path) -> None:
    """And a read of one is refused, naming it (it would compute on a placeholder)."""
    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, n_persist=0, n_buffer=2))
    for name, param in engine.module.named_parameters():
        assert param.untyped_storage().nbytes() <= 4 and param.shape == param.data.shape
        with pytest.raises(ReleasedParameterError, match=rf"^{name} was read"):
            torch.isnan(param)
    engine.close()


def test_too_few_buffers_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(
        SpecError,
        match=r"memory.n_buffer=0 is too few: module .* uses 2 non-persistent chunks.*n_buffer >= 2",
    ):
        runtime.initialize(tiny_gpt(), config=job(tmp_path, n_persist=0, n_buffer=0))
    with pytest.raises(SpecError, match="memory.n_persist=13 exceeds the model's 12 chunks"):
        runtime.initialize(tiny_gpt(), config=job(tmp_path, n_persist=13))


def test_clipped_windows_never_update_early_and_match(tmp_path: Path) -> None:
    """A clipped window's update waits for the global norm: on CPU, where host work takes the
    cores compute uses, every update is deferred to the step. No chunk is updated early, so
    nothing is ever undone (and no undo copy is kept)."""
    reference = gpt_reference(steps=6, lr=1e-3, weight_decay=0.1, clip=0.05)
    config = job(tmp_path, n_persist=3, n_buffer=2)
    config["gradient_clipping"] = 0.05
    engine = runtime.initialize(tiny_gpt(), config=config)
    assert engine.plan.update_mode is UpdateMode.DEFERRED and engine.chunks.update_mode is UpdateMode.DEFERRED
    train(engine, 6)
    # The clip coefficient is rounded differently (norm over flat shards): the key biases'
    # Adam updates amplify that, within the float64 noise floor.
    assert_matches_reference(engine.state_dict(), reference.fp32, reference.fp64)
    assert engine.chunks.num_speculations == 0
    engine.close()


@pytest.mark.parametrize(
    ("clip", "fp16", "accumulation", "cuda", "expected"),
    [
        (0.0, False, 1, False, UpdateMode.ON_ARRIVAL),
        (0.0, False, 2, True, UpdateMode.EARLY),
        (1.0, False, 1, False, UpdateMode.DEFERRED),
        (1.0, False, 2, True, UpdateMode.TWO_PHASE),
        (0.0, True, 1, True, UpdateMode.TWO_PHASE),
        (0.0, True, 1, False, UpdateMode.DEFERRED),
    ],
)
def test_the_plans_update_mode_follows_the_norm_the_window_and_the_device(
    tmp_path: Path, clip: float, fp16: bool, accumulation: int, cuda: bool, expected: UpdateMode
) -> None:
    """Early updates only when no norm is needed (on arrival without accumulation); else two
    phases where host work runs beside compute (CUDA), deferred on CPU. The plan carries it, and
    a mode the job rules out is refused when the plan is applied."""
    settings = {"gradient_clipping": clip, "gradient_accumulation_steps": accumulation}
    if fp16:
        settings["precision"] = "fp16"
    planning = planning_settings_from_spec(validate_spec({**job(tmp_path), **settings}, source="test"))
    mode = UpdateMode.of(
        keeps_gradients=planning.keeps_gradients,
        updates_after_norm=planning.updates_after_norm,
        host_beside_compute=cuda,
    )
    assert mode is expected
    if not cuda and not fp16:  # what this CPU machine can run
        config = job(tmp_path, n_persist=3, n_buffer=2)
        config.update(settings)
        with runtime.initialize(tiny_gpt(), config=config) as engine:
            assert engine.plan.update_mode is expected and engine.chunks.update_mode is expected
            early = dataclasses.replace(engine.plan, update_mode=UpdateMode.EARLY)
            if clip:
                with pytest.raises(SpecError, match="update_mode early: clipping and fp16 updates wait"):
                    engine.switch_plan(early)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_two_phase_clipped_step_is_bit_exact_and_keeps_no_snapshot(tmp_path: Path, accumulation: int) -> None:
    """Two-phase: no early update and no undo snapshot; the step's clipped updates of offloaded
    chunks run on the host worker while the next forward starts, each chunk's gather waiting for
    its own. The same numbers as updating every chunk at the step (and as plain PyTorch)."""
    reference = gpt_reference(steps=4, lr=1e-3, weight_decay=0.1, clip=0.05, accumulation=accumulation)
    states = {}
    for mode in ("deferred", "two_phase"):
        config = job(tmp_path / mode, n_persist=3, n_buffer=2)
        config.update(gradient_clipping=0.05, gradient_accumulation_steps=accumulation)
        example = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=1).batch(0, 0, 0)
        engine = runtime.initialize(tiny_gpt(), config=config, example_batch=example)  # planned up front
        if mode == "two_phase":  # as on CUDA: the PlanController rebuilds the managers for it
            engine.switch_plan(dataclasses.replace(engine.plan, update_mode=UpdateMode.TWO_PHASE))
        assert engine.chunks.update_mode.value == mode
        train(engine, 4, accumulation=accumulation)
        if mode == "two_phase":
            offloaded = range(3, engine.plan.num_chunks)
            assert all(engine.chunks.optimizer.pending_update(c) is not None for c in offloaded)
        states[mode] = engine.state_dict()  # drains the host worker first
        engine.close()
    assert_state_equal(states["two_phase"], states["deferred"])
    assert_matches_reference(states["two_phase"], reference.fp32, reference.fp64)


def test_chunk_smaller_than_a_parameter_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(
        SpecError, match=r"memory.chunk_size=32768 is too small: parameter wte.weight takes 65,536"
    ):
        runtime.initialize(tiny_gpt(), config=job(tmp_path, chunk_size=32768))

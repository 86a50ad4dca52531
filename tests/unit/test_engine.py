"""The engine on one rank equals plain PyTorch (fp32, torch.optim.AdamW, same seed and batch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from protrain import runtime
from protrain.runtime.planning.profilers import Profilers
from protrain.runtime.training.update import NonFiniteLossError
from tests.helpers import (
    assert_matches_reference,
    assert_state_close,
    assert_state_equal,
    gpt_reference,
    lm_batches,
    tiny_gpt,
    train_engine,
    train_reference,
)

STEPS = 20


def job(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "output_dir": str(tmp_path / "runs"),
    }
    spec.update(overrides)
    return spec


def test_bit_exact_with_plain_pytorch_without_accumulation(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, ref_losses = train_reference(tiny_gpt(), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    actual, losses = train_engine(tiny_gpt(), data, job(tmp_path), steps=STEPS)
    assert_state_equal(actual, expected)
    assert losses == ref_losses


def test_accumulation_schedule_and_triggering_clip_match_plain_pytorch(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=4, world_size=1)
    reference = gpt_reference(
        accumulation=4, steps=STEPS, lr=1e-3, weight_decay=0.1, clip=0.05, warmup_cosine=(5, STEPS, 0.1)
    )
    config = job(
        tmp_path,
        gradient_accumulation_steps=4,
        gradient_clipping=0.05,
        scheduler={"type": "warmup_cosine", "warmup_steps": 5, "total_steps": STEPS, "min_lr_ratio": 0.1},
    )
    actual, losses = train_engine(tiny_gpt(), data, config, steps=STEPS)
    # The clip coefficient comes from a norm summed over flat shards instead of torch's norm of
    # per-tensor norms: equal up to rounding, hence the tolerance rather than bit-equality (and
    # the float64 floor for the key biases, whose updates are that rounding amplified by Adam).
    assert_matches_reference(actual, reference.fp32, reference.fp64)
    assert losses == pytest.approx(reference.losses, rel=1e-6)
    (metrics,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    norms = [record["grad_norm"] for record in records if "step" in record]
    assert min(norms) > 0.05, "the clip must trigger on every update for this test to mean anything"


class Branchy(nn.Module):
    """A frozen input layer and a branch that only some steps use."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.trunk(torch.relu(self.frozen(x)))
        if use_branch:
            h = h + self.branch(h)
        return (h**2).mean()


def test_unused_and_frozen_parameters_match_plain_adamw(tmp_path: Path) -> None:
    torch.manual_seed(0)
    inputs = [torch.randn(4, 8) for _ in range(6)]
    torch.manual_seed(1)
    reference = Branchy()
    torch.manual_seed(1)
    model = Branchy()
    optimizer = torch.optim.AdamW(
        [
            {"params": [reference.trunk.weight, reference.branch.weight], "weight_decay": 0.1},
            {"params": [reference.trunk.bias, reference.branch.bias], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
        fused=True,
    )
    from protrain import runtime

    engine = runtime.initialize(model, config=job(tmp_path, optimizer={"lr": 1e-2, "weight_decay": 0.1}))
    for step, x in enumerate(inputs):
        use = step % 3 == 0
        reference(x, use).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.backward(engine(x, use))
        engine.step()
    assert_state_equal(engine.state_dict(), reference.state_dict())
    assert torch.equal(model.frozen.weight, reference.frozen.weight)
    engine.close()


def test_a_branch_left_unused_after_a_step_counts_zero_in_the_gradient_norm(tmp_path: Path) -> None:
    """Gradient shards that take gradients in place are not zeroed between windows (the window's
    first gradient is copied over them): a parameter with none in a window must still count as
    zero in the window's norm (logged, and what clipping scales by) and be left alone by the
    update. The branch is used in the first step only, its gradient then the largest."""
    torch.manual_seed(0)
    inputs = [torch.randn(4, 8) * (30.0 if step == 0 else 1.0) for step in range(6)]
    torch.manual_seed(1)
    reference = Branchy()
    torch.manual_seed(1)
    model = Branchy()
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-3, foreach=False)
    from protrain import runtime

    config = job(
        tmp_path,
        optimizer={"type": "sgd", "lr": 1e-3, "weight_decay": 0.0},
        # Every knob set: no re-plan after the first batch (a new store would start from zeros).
        memory={"chunk_size": "4KiB", "n_persist": 2, "n_buffer": 0, "n_swap": 0, "n_checkpoint": 0},
    )
    engine = runtime.initialize(model, config=config)
    for step, x in enumerate(inputs):
        use = step == 0
        reference(x, use).backward()
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.backward(engine(x, use))
        engine.step()
        assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-5), f"step {step}"
    assert_state_close(engine.state_dict(), reference.state_dict())
    engine.close()


@pytest.mark.skips_steps
def test_nonfinite_loss_raise_and_skip(tmp_path: Path) -> None:
    from protrain import runtime

    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path))
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    out = engine(**data.batch(0, 0, 0))
    engine.backward(out.loss * float("nan"))
    with pytest.raises(NonFiniteLossError, match="on_nonfinite_loss: skip"):
        engine.step()
    engine.close()

    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, on_nonfinite_loss="skip"))
    before = engine.state_dict()
    out = engine(**data.batch(0, 0, 0))
    engine.backward(out.loss * float("inf"))
    assert engine.step() is False
    assert (engine.global_step, engine.skipped_steps) == (0, 1)
    assert_state_equal(engine.state_dict(), before)
    out = engine(**data.batch(1, 0, 0))
    engine.backward(out.loss)
    assert engine.step() is True
    assert engine.global_step == 1
    engine.close()


@pytest.mark.skips_steps
def test_fp16_overflow_skips_the_step_and_lowers_the_scale(tmp_path: Path) -> None:
    from protrain import runtime

    config = job(
        tmp_path,
        precision="fp16",
        loss_scaling={"initial": 3.0e38, "growth_interval": 1000, "min_scale": 1.0},
    )
    engine = runtime.initialize(tiny_gpt(), config=config)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    before = engine.state_dict()
    out = engine(**data.batch(0, 0, 0))
    engine.backward(out.loss)
    assert engine.step() is False
    assert engine.loss_scaler is not None and engine.loss_scaler.scale == pytest.approx(1.5e38)
    assert_state_equal(engine.state_dict(), before)
    for update in range(1, 200):
        out = engine(**data.batch(update, 0, 0))
        engine.backward(out.loss)
        if engine.step():
            break
    assert engine.global_step == 1 and engine.skipped_steps >= 1
    engine.close()


def test_metrics_file_has_one_record_per_update(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=2, world_size=1)
    train_engine(tiny_gpt(), data, job(tmp_path, gradient_accumulation_steps=2), steps=3)
    (metrics,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[0]["event"] == "plan"
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 and not r["skipped"] for r in steps)


def test_eval_forward_does_not_change_training(tmp_path: Path) -> None:
    """A no-grad evaluation forward between updates (even with offloaded chunks) leaves the
    training run bit-identical to one without it."""
    from protrain import runtime

    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    states = []
    for evaluate in (False, True):
        config = job(tmp_path, memory={"chunk_size": "64KiB", "n_persist": 2, "n_buffer": 2})
        engine = runtime.initialize(tiny_gpt(), config=config)
        for update in range(4):
            if evaluate:
                engine.eval()
                with torch.no_grad():
                    assert torch.isfinite(engine(**data.batch(100 + update, 0, 0)).loss)
                engine.train()
            engine.backward(engine(**data.batch(update, 0, 0)).loss)
            engine.step()
        states.append(engine.state_dict())
        engine.close()
    assert_state_equal(states[1], states[0])
    assert set(states[0]) == set(tiny_gpt().state_dict())


def test_memory_knobs_set_by_hand_are_obeyed_or_refused_clearly(tmp_path: Path) -> None:
    from protrain import runtime
    from protrain.runtime.config.spec_io import SpecError

    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, memory={"n_swap": 1}))
    assert [mode.value for mode in engine.plan.block_modes] == ["swap", "keep"]
    engine.close()
    # Model state larger than the budget: every chunk offloaded (no example batch to search with).
    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, memory={"device_budget": "1MiB"}))
    assert engine.plan.n_persist == 0 and engine.plan.rule.startswith("conservative")
    engine.close()
    # Not even the buffers fit: refused before training, naming the budget.
    with pytest.raises(SpecError, match="memory.device_budget"):
        runtime.initialize(tiny_gpt(), config=job(tmp_path, memory={"device_budget": "64KiB"}))


def test_two_engines_in_one_process_keep_separate_run_folders(tmp_path: Path) -> None:
    """Started in the same second by the same process, each still gets its own metrics file."""
    config = {"output_dir": str(tmp_path / "runs")}
    for _ in range(2):
        runtime.initialize(tiny_gpt(), config=config).close()
    assert len(list((tmp_path / "runs").glob("*/metrics.jsonl"))) == 2


def test_the_engine_waits_for_the_device_only_at_the_updates_whose_time_it_reads(tmp_path: Path) -> None:
    """A full device synchronize at an update's end keeps the host from queueing the next
    forward while the device finishes the update. The engine waits only where the time is read:
    the plan check's updates, update 1 and every ``logging.every_steps`` (before: every update)."""
    waits: list[int] = []
    profilers = Profilers(synchronize=lambda info: waits.append(1))
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    config = job(tmp_path, logging={"every_steps": 4})
    with runtime.initialize(tiny_gpt(), config=config, profilers=profilers) as engine:

        def train(updates: range) -> None:
            for update in updates:
                out = engine(**data.batch(update, 0, 0))
                engine.backward(out.loss)
                engine.step()

        train(range(6))
        assert not engine._plans.measuring, "the plan check measured its updates"
        waits.clear()
        train(range(6, 14))  # updates 7 to 14
    assert len(waits) == 2  # updates 8 and 12


@pytest.mark.parametrize(
    ("memory", "accumulation"),
    [
        ({"n_persist": "auto"}, 1),
        ({"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2}, 1),
        ({"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2}, 2),
    ],
    ids=["persistent", "offloaded-applied-on-arrival", "offloaded-kept"],
)
def test_the_gradient_norm_is_there_every_update_without_clipping(
    tmp_path: Path, memory: dict[str, Any], accumulation: int
) -> None:
    """torchtitan and the Trainer log the gradient norm every update; the engine took it only to
    clip or unscale. Now every update has it, equal to plain PyTorch's total norm: from the
    shards, or where offloaded gradients are applied as they arrive, from the squares the host
    worker takes of each."""
    data = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=1)
    expected: list[float] = []
    train_reference(tiny_gpt(), data, steps=3, lr=1e-3, weight_decay=0.1, norms=expected)
    config = job(tmp_path, gradient_accumulation_steps=accumulation, memory=memory)
    norms = []
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        for update in range(3):
            for micro in range(accumulation):
                out = engine(**data.batch(update, micro, 0))
                engine.backward(out.loss)
                engine.step()
            norms.append(engine.get_global_grad_norm())
    assert norms == pytest.approx(expected, rel=1e-5)

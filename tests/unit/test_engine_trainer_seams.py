"""What a training loop of someone else's (a Hugging Face Trainer) drives the engine through,
each checked against plain PyTorch doing the same by hand:

- ``set_gradient_accumulation_boundary``: windows of any length (an epoch's short last one);
- ``backward(loss, scale_wrt_gas=False)``: a loss the caller already normalised over its window;
- ``lr_from_optimizer``: learning rates per group written into ``engine.optimizer``'s param
  groups by a torch scheduler;
- ``was_step_applied``: a skipped update says so, and changed nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from protrain import runtime
from tests.helpers import assert_matches_reference, lm_batches, reference_param_groups, tiny_gpt

LR = 2e-3
WINDOWS = (3, 3, 2, 3, 1)
"""Micro-batches per update: accumulation 3 with short windows, as a Trainer's epoch ends."""


def job(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 3,
        "optimizer": {"lr": LR, "weight_decay": 0.1},
        # Some chunks persistent (AdamW on the device path), the others offloaded (CPU Adam).
        "memory": {"chunk_size": "64KiB", "n_persist": 2, "n_buffer": 3},
        "output_dir": str(tmp_path / "runs"),
        **extra,
    }


def metrics_records(tmp_path: Path) -> list[dict[str, Any]]:
    (metrics,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    return [record for line in metrics.read_text().splitlines() if "step" in (record := json.loads(line))]


def train_windows_by_hand(dtype: torch.dtype, clip: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """torch.optim.AdamW over WINDOWS, each micro-batch's loss divided by its window's length;
    the final state and the gradient norm of each update (clipping only)."""
    model = tiny_gpt(0).to(dtype)
    data = lm_batches(micro_batch_size=2, accumulation=3, world_size=1)
    optimizer = torch.optim.AdamW(
        reference_param_groups(model, 0.1), lr=LR, betas=(0.9, 0.95), fused=dtype == torch.float32
    )
    norms = []
    for update, length in enumerate(WINDOWS):
        for micro in range(length):
            (model(**data.batch(update, micro, 0)).loss / length).backward()
        if clip > 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        else:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms.append(float(torch.nn.utils.get_total_norm(grads)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_short_windows_of_caller_normalised_losses_train_like_torch(tmp_path: Path, clip: float) -> None:
    engine = runtime.initialize(tiny_gpt(0), config=job(tmp_path, gradient_clipping=clip))
    assert 0 < engine.plan.n_persist < engine.plan.num_chunks  # both update paths run
    data = lm_batches(micro_batch_size=2, accumulation=3, world_size=1)
    window_losses, norms = [], []
    with engine:
        for update, length in enumerate(WINDOWS):
            losses = []
            for micro in range(length):
                engine.set_gradient_accumulation_boundary(micro == length - 1)
                loss = engine(**data.batch(update, micro, 0)).loss
                engine.backward(loss / length, scale_wrt_gas=False)
                losses.append(loss.item())
                assert engine.step() == (micro == length - 1)
            window_losses.append(sum(losses) / length)
            norms.append(engine.get_global_grad_norm())
        assert engine.global_step == len(WINDOWS) and engine.micro_step == sum(WINDOWS)
        state = engine.state_dict()
    (fp32, torch_norms), (fp64, _) = (train_windows_by_hand(t, clip) for t in (torch.float32, torch.float64))
    assert_matches_reference(state, fp32, fp64)
    # The norm of each update, before clipping (taken without clipping too: it is logged).
    assert norms == pytest.approx(torch_norms, rel=1e-5)
    # The window's reported loss is its normalised losses' sum: the mean of its micro-batches'.
    reported = [record["loss"] for record in metrics_records(tmp_path)]
    assert reported == pytest.approx(window_losses, rel=1e-6)


def test_without_a_signal_the_window_counts_gradient_accumulation_steps(tmp_path: Path) -> None:
    """After the signal goes back to None, every third step() updates again, and the default
    backward divides by the accumulation as before."""
    engine = runtime.initialize(tiny_gpt(0), config=job(tmp_path))
    data = lm_batches(micro_batch_size=2, accumulation=3, world_size=1)
    with engine:
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(**data.batch(0, 0, 0)).loss)
        assert engine.step() and engine.global_step == 1
        engine.set_gradient_accumulation_boundary(None)
        updated = []
        for micro in range(6):
            engine.backward(engine(**data.batch(1, micro % 3, 0)).loss)
            updated.append(engine.step())
        assert updated == [False, False, True, False, False, True]


def test_a_boundary_moved_between_backward_and_step_and_a_mid_window_zero_grad_are_refused(
    tmp_path: Path,
) -> None:
    engine = runtime.initialize(tiny_gpt(0), config=job(tmp_path))
    data = lm_batches(micro_batch_size=2, accumulation=3, world_size=1)
    with engine:
        engine.zero_grad()  # between windows: nothing to drop, as training loops call it
        engine.set_gradient_accumulation_boundary(False)
        engine.backward(engine(**data.batch(0, 0, 0)).loss)
        engine.set_gradient_accumulation_boundary(True)
        with pytest.raises(RuntimeError, match="boundary changed between backward and step"):
            engine.step()
        with pytest.raises(RuntimeError, match="zero_grad in the middle of an accumulation window"):
            engine.zero_grad()


def by_hand_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The spec's groups below, written out as torch param groups: group 0 the top level (biases
    and norms without decay), group 1 ``blocks.1.*`` at lr 5e-3 (its biases and norms too)."""
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    groups: list[dict[str, Any]] = [
        {"params": [], "weight_decay": 0.1, "lr": LR},
        {"params": [], "weight_decay": 0.0, "lr": LR},
        {"params": [], "weight_decay": 0.1, "lr": 5e-3},
        {"params": [], "weight_decay": 0.0, "lr": 5e-3},
    ]
    for name, param in model.named_parameters():
        exempt = name.endswith("bias") or id(param) in norms
        groups[2 * name.startswith("blocks.1.") + exempt]["params"].append(param)
    return groups


def factors(step: int) -> float:
    return 1.0 / (1 + step)


def factors_second(step: int) -> float:
    return math.cos(step / 4)


def train_lrs_by_hand(dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """The same LambdaLR (one factor per engine group) over torch.optim.AdamW."""
    model = tiny_gpt(0).to(dtype)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    groups = by_hand_groups(model)
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), fused=dtype == torch.float32)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [factors] * 2 + [factors_second] * 2)
    seen = []
    for update in range(5):
        seen.append([group["lr"] for group in optimizer.param_groups[::2]])
        model(**data.batch(update, 0, 0)).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, seen


def test_learning_rates_a_torch_scheduler_writes_into_the_optimizer_facade_are_used(tmp_path: Path) -> None:
    config = job(tmp_path, gradient_accumulation_steps=1)
    config["optimizer"]["groups"] = [{"match": ["blocks.1.*"], "lr": 5e-3}]
    config["scheduler"] = {"type": "warmup_cosine", "warmup_steps": 3, "total_steps": 5}  # not used
    engine = runtime.initialize(tiny_gpt(0), config=config)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with engine:
        optimizer = engine.optimizer
        assert optimizer is engine.optimizer and len(optimizer.param_groups) == 2
        trainable = sum(1 for p in engine.module.parameters() if p.requires_grad)
        assert sum(len(group["params"]) for group in optimizer.param_groups) == trainable
        assert optimizer.param_groups[1]["match"] == ("blocks.1.*",)
        engine.lr_from_optimizer = True
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [factors, factors_second])
        seen = []
        for update in range(5):
            seen.append(list(engine.group_lrs))
            engine.backward(engine(**data.batch(update, 0, 0)).loss)
            engine.step()
            optimizer.step()  # a torch loop's call: the engine already updated, nothing happens
            scheduler.step()
        state = engine.state_dict()
    (fp32, lrs), (fp64, _) = train_lrs_by_hand(torch.float32), train_lrs_by_hand(torch.float64)
    assert [lr for lrs_of_update in seen for lr in lrs_of_update] == pytest.approx(sum(lrs, []))
    assert_matches_reference(state, fp32, fp64)
    assert [record["lr"] for record in metrics_records(tmp_path)] == pytest.approx([lr[0] for lr in lrs])


def test_the_facade_shows_the_spec_schedule_while_the_engine_owns_the_lr(tmp_path: Path) -> None:
    config = job(tmp_path, gradient_accumulation_steps=1)
    config["scheduler"] = {"type": "warmup_cosine", "warmup_steps": 2, "total_steps": 4}
    engine = runtime.initialize(tiny_gpt(0), config=config)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with engine:
        optimizer = engine.optimizer
        for update in range(3):
            assert optimizer.param_groups[0]["lr"] == pytest.approx(engine.lr)
            optimizer.param_groups[0]["lr"] = 1.0  # not the owner: overwritten, never used
            engine.backward(engine(**data.batch(update, 0, 0)).loss)
            engine.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(engine.lr) != 1.0


@pytest.mark.skips_steps
def test_a_skipped_update_says_so_and_changes_nothing(tmp_path: Path) -> None:
    config = job(tmp_path, gradient_accumulation_steps=1, on_nonfinite_loss="skip")
    engine = runtime.initialize(tiny_gpt(0), config=config)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with engine:
        assert not engine.was_step_applied()  # no update yet
        applied = []
        for update in range(3):
            before = engine.state_dict()
            loss = engine(**data.batch(update, 0, 0)).loss
            engine.backward(loss * float("nan") if update == 1 else loss)
            engine.step()
            applied.append((engine.was_step_applied(), engine.optimizer.step_was_skipped))
            after = engine.state_dict()
            unchanged = all(torch.equal(after[name], before[name]) for name in before)
            assert unchanged == (update == 1)
        assert applied == [(True, False), (False, True), (True, False)]
        assert engine.global_step == 2 and engine.skipped_steps == 1


def test_the_facade_shows_the_resumed_schedule_after_a_checkpoint_loads(tmp_path: Path) -> None:
    """A checkpoint moves the update count, so the spec schedule's next learning rate with it:
    the facade (made before the load) shows that one, not the fresh engine's first."""
    config = job(tmp_path, gradient_accumulation_steps=1)
    config["scheduler"] = {"type": "warmup_cosine", "warmup_steps": 2, "total_steps": 6}
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with runtime.initialize(tiny_gpt(0), config=config) as engine:
        for update in range(3):
            engine.backward(engine(**data.batch(update, 0, 0)).loss)
            engine.step()
        saved = engine.save_checkpoint(tmp_path / "ckpt")
    with runtime.initialize(tiny_gpt(0), config=config) as resumed:
        fresh = resumed.optimizer.param_groups[0]["lr"]
        resumed.load_checkpoint(saved)
        assert resumed.global_step == 3 and resumed.lr != pytest.approx(fresh)
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(resumed.lr)

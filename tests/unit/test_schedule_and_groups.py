"""Learning-rate schedules (hand-computed values) and weight-decay groups."""

from __future__ import annotations

import math

import pytest
from torch import nn

from protrain.runtime.config.settings import ScheduleSettings
from protrain.runtime.config.spec import SchedulerType
from protrain.runtime.param_groups import split_decay
from protrain.runtime.training.schedule import lr_factor
from tests.helpers import tiny_gpt


def cosine(warmup: int, total: int, ratio: float) -> ScheduleSettings:
    return ScheduleSettings(
        kind=SchedulerType.WARMUP_COSINE, warmup_steps=warmup, total_steps=total, min_lr_ratio=ratio
    )


def test_warmup_is_linear_up_to_peak() -> None:
    schedule = cosine(4, 20, 0.1)
    assert [lr_factor(i, schedule) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_reaches_min_ratio_at_total_and_stays() -> None:
    schedule = cosine(0, 10, 0.1)
    assert lr_factor(0, schedule) == pytest.approx(1.0)
    assert lr_factor(5, schedule) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(10, schedule) == pytest.approx(0.1)
    assert lr_factor(50, schedule) == pytest.approx(0.1)


def test_cosine_midpoint_after_warmup() -> None:
    schedule = cosine(10, 110, 0.0)
    assert lr_factor(60, schedule) == pytest.approx(0.5)
    assert lr_factor(35, schedule) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))


def test_constant_with_warmup() -> None:
    schedule = ScheduleSettings(
        kind=SchedulerType.CONSTANT, warmup_steps=2, total_steps=None, min_lr_ratio=0.1
    )
    assert [lr_factor(i, schedule) for i in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_no_decay_for_biases_and_norms_tied_weight_once() -> None:
    model = tiny_gpt()
    decay, no_decay = split_decay(model, ("bias", "norm"))
    decay_names = {p.name for p in decay}
    no_decay_names = {p.name for p in no_decay}
    assert "wte.weight" in decay_names and "lm_head.weight" not in decay_names  # tied: listed once
    assert "blocks.0.attn.qkv.weight" in decay_names
    assert {
        "blocks.0.ln_1.weight",
        "blocks.0.ln_1.bias",
        "blocks.0.attn.proj.bias",
        "ln_f.weight",
    } <= no_decay_names
    assert not decay_names & no_decay_names
    assert len(decay) + len(no_decay) == len(list(model.parameters()))


def test_frozen_parameters_are_left_out() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].requires_grad_(False)
    decay, no_decay = split_decay(model, ("bias",))
    assert [p.name for p in decay] == ["1.weight"] and [p.name for p in no_decay] == ["1.bias"]

"""``optimizer.groups``: per-group learning rate, weight decay and betas, as a user sets them.

The engine under groups trains like ``torch.optim.AdamW`` given the same param groups by hand
(persistent chunks and offloaded ones, so both update paths), the first matching entry wins, a
shared parameter matches through any of its names, biases and norms stay exempt from a group's
weight decay, an entry may match nothing, the plan output shows the groups, and a run stopped
and resumed ends bit-identical. Bad entries are refused naming the entry's key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from protrain import runtime
from protrain.runtime.config.settings import settings_from_spec
from protrain.runtime.config.spec_io import SpecError, validate_spec
from protrain.runtime.param_groups import resolve_param_hyper
from protrain.runtime.training.schedule import build_scheduler
from tests.checkpointing import checkpoint_job, train_until
from tests.helpers import assert_matches_reference, assert_state_equal, lm_batches, tiny_gpt

STEPS = 6
LR = 1e-3
GROUPS = [
    {"match": ["blocks.0.*"], "lr": 3e-3},
    {"match": ["blocks.0.mlp.*", "blocks.1.mlp.*"], "weight_decay": 0.01, "betas": [0.8, 0.9]},
    {"match": ["no_such_module.*"], "lr": 1.0},
    {"match": ["lm_head.weight"], "lr": 5e-4, "weight_decay": 0.2},
]
"""Entry 1 wins blocks.0.mlp over entry 2 (first match); entry 3 matches nothing; entry 4 takes
the embedding tied to the head through its second name."""


def job(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": LR, "weight_decay": 0.1, "groups": GROUPS},
        "scheduler": {"type": "warmup_cosine", "warmup_steps": 2, "total_steps": STEPS},
        # Some chunks persistent (AdamW on the device path), the others offloaded (CPU Adam).
        "memory": {"chunk_size": "64KiB", "n_persist": 2, "n_buffer": 3},
        "output_dir": str(tmp_path / "runs"),
        **extra,
    }


def by_hand(model: nn.Module) -> list[dict[str, Any]]:
    """GROUPS written out as torch param groups, independently of runtime.param_groups."""

    def no_decay(name: str) -> bool:
        return name.endswith("bias") or ".ln_" in name or name.startswith("ln_f")

    groups: dict[tuple[float, float, tuple[float, float]], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():  # wte.weight stands for the tied lm_head.weight
        if name.startswith("blocks.0."):
            lr, decay, betas = 3e-3, 0.1, (0.9, 0.95)
        elif name.startswith("blocks.1.mlp."):
            lr, decay, betas = LR, 0.01, (0.8, 0.9)
        elif name == "wte.weight":
            lr, decay, betas = 5e-4, 0.2, (0.9, 0.95)
        else:
            lr, decay, betas = LR, 0.1, (0.9, 0.95)
        groups.setdefault((lr, 0.0 if no_decay(name) else decay, betas), []).append(param)
    return [
        {"params": params, "lr": lr, "weight_decay": decay, "betas": betas}
        for (lr, decay, betas), params in groups.items()
    ]


def train_by_hand(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = tiny_gpt(0).to(dtype)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    optimizer = torch.optim.AdamW(by_hand(model), lr=LR, fused=dtype == torch.float32)
    warmup_cosine = settings_from_spec(validate_spec(job(Path(".")), source="test")).schedule
    scheduler = build_scheduler(optimizer, warmup_cosine)
    for update in range(STEPS):
        model(**data.batch(update, 0, 0)).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_groups_train_like_torch_adamw_given_the_same_groups(tmp_path: Path) -> None:
    engine = runtime.initialize(tiny_gpt(0), config=job(tmp_path))
    assert 0 < engine.plan.n_persist < engine.plan.num_chunks  # both update paths run
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with engine:
        assert engine.group_lrs[0] == engine.lr and len(engine.group_lrs) == 1 + len(GROUPS)
        for update in range(STEPS):
            engine.backward(engine(**data.batch(update, 0, 0)).loss)
            engine.step()
        state = engine.state_dict()
    assert_matches_reference(state, train_by_hand(torch.float32), train_by_hand(torch.float64))
    # Without the groups the result is another one: the groups were not ignored.
    plain = job(tmp_path / "plain")
    plain["optimizer"] = {"lr": LR, "weight_decay": 0.1}
    other = runtime.initialize(tiny_gpt(0), config=plain)
    with other:
        for update in range(STEPS):
            other.backward(other(**data.batch(update, 0, 0)).loss)
            other.step()
        ungrouped = other.state_dict()["blocks.0.attn.qkv.weight"]
    assert not torch.allclose(ungrouped, state["blocks.0.attn.qkv.weight"])


def test_first_match_wins_aliases_match_and_no_decay_stays_exempt() -> None:
    model = tiny_gpt(0)
    settings = settings_from_spec(validate_spec(job(Path(".")), source="test")).optimizer
    names = [
        ("wte.weight", "lm_head.weight"),
        ("blocks.0.mlp.fc.weight",),
        ("blocks.1.mlp.fc.weight",),
        ("blocks.1.mlp.fc.bias",),
        ("blocks.1.attn.qkv.weight",),
    ]
    hyper = resolve_param_hyper(model, names, settings)
    assert hyper.group_of_param == (4, 1, 2, 2, 0)
    assert hyper.weight_decay == (0.2, 0.1, 0.01, 0.0, 0.1)  # the mlp bias: exempt within its group
    assert hyper.lrs == (LR, 3e-3, LR, 1.0, 5e-4)
    assert hyper.betas[2] == (0.8, 0.9) and hyper.betas[1] == (0.9, 0.95)


def test_the_plan_output_lists_the_groups_with_what_each_took(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with runtime.initialize(tiny_gpt(0), config=job(tmp_path)):
        pass
    out = capsys.readouterr().out
    assert "Optimizer groups" in out
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines()]
    rows = {row[0]: row for row in cells if len(row) == 7 and row[0].isdigit()}
    assert sorted(rows) == ["0", "1", "2", "3", "4"]
    # blocks.0.* holds 12 parameter tensors; entry 3 took none; entry 4 the tied embedding.
    assert rows["1"][1] == "blocks.0.*" and rows["1"][5] == "12"
    assert rows["3"][5] == "0" and rows["3"][6] == "0"
    assert rows["4"][2] == "0.0005" and rows["4"][5] == "1"


def test_a_run_with_groups_stopped_and_resumed_ends_bit_identical(tmp_path: Path) -> None:
    groups = {"optimizer": {"lr": 2e-3, "weight_decay": 0.1, "groups": GROUPS}}
    whole = train_until(checkpoint_job(str(tmp_path / "whole"), **groups), until=6)
    first = train_until(checkpoint_job(str(tmp_path), checkpoint={"interval_steps": 3}, **groups), until=3)
    second = train_until(checkpoint_job(str(tmp_path), **groups), until=6)
    assert second["started_at"] == 3
    assert first["losses"] + second["losses"] == whole["losses"]
    assert_state_equal(second["state"], whole["state"])


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([{"match": ["x"], "lrr": 1.0}], "optimizer.groups.0.lrr: unknown key 'lrr'; allowed keys here"),
        ([{"lr": 1.0}], "optimizer.groups.0.match: required key is missing"),
        ([{"match": ["a"]}, {"match": ["b"], "lr": -1}], "optimizer.groups.1.lr: got -1; allowed: a number"),
        ([{"match": []}], "optimizer.groups.0.match: got []; allowed: a non-empty list"),
        ("blocks", "optimizer.groups: got 'blocks' (str); allowed: a list of {match"),
    ],
)
def test_bad_group_entries_are_refused_naming_the_key(groups: Any, message: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_spec({"optimizer": {"groups": groups}}, source="job.yaml")
    assert f"job.yaml: {message}" in str(err.value)

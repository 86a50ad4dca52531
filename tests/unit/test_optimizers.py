"""adam, lion and sgd over one flat shard against their references on separate parameters:
``torch.optim.Adam`` and ``torch.optim.SGD`` (for-loop, ``foreach=False``) within DESIGN section
6's tolerance, Lion bit for bit against the published rule written out here (and within the
tolerance of the ``lion-pytorch`` package). Odd sizes, segments cut across the kernel's batch
limit, two parameter groups with their own learning rates and betas, per-segment weight decay,
segments that get no gradient in a step, a learning rate changed per step, and a state saved and
restored in the middle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from protrain.runtime.optim.registry import rule_named
from protrain.runtime.optim.rule import OptimizerHyper
from tests.helpers import RELATIVE_TOLERANCE

GAP = 3  # padding around segments, which no segment owns and no update may touch
LRS: tuple[float | None, ...] = (2e-3, None, 5e-4, 3e-3, 1e-3, 7e-4)
"""Per step: the learning rate of group 0 (group 1 takes twice it); None: the constructor's."""
BASE_LRS = (1e-3, 2e-3)
GROUP_BETAS = ((0.9, 0.99), (0.8, 0.95))
LAYOUT = ((22, 0.1, 0), (1023, 0.0, 1), (70001, 0.1, 0), (7, 0.0, 0), (5003, 0.2, 1), (131, 0.1, 1))
"""(numel, weight decay, group) per segment."""
WORKSPACE = 1000
"""The kernel's batch limit in these tests: the 70001 and 5003 segments are cut into pieces."""


def published_lion_step(
    param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, *, lr: float, wd: float, b1: float, b2: float
) -> None:
    """Lion as published (Chen et al. 2023, Algorithm 2), decoupled weight decay."""
    c = b1 * m + (1 - b1) * grad
    param *= 1 - lr * wd
    param -= lr * torch.sign(c)
    m.copy_(b2 * m + (1 - b2) * grad)


class PublishedLion(torch.optim.Optimizer):
    """``published_lion_step`` per parameter, as an optimizer (the engine-level references)."""

    def __init__(self, groups: list[dict[str, Any]], betas: tuple[float, float]) -> None:
        super().__init__(groups, {"betas": betas, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                m = self.state[param].setdefault("exp_avg", torch.zeros_like(param))
                published_lion_step(param, param.grad, m, lr=group["lr"], wd=group["weight_decay"], b1=b1, b2=b2)


def inactive(step: int, segment: int) -> bool:
    """Segment 0 misses the first step (SGD's momentum buffer then starts at the second); the
    others each miss one step."""
    return step == segment % len(LRS)


def shard(seed: int = 0) -> tuple[torch.Tensor, list[tuple[int, int, float, int]]]:
    """A flat master with LAYOUT's segments separated by padding, listed in reverse memory order."""
    segments = []
    offset = GAP
    for numel, decay, group in LAYOUT:
        segments.append((offset, numel, decay, group))
        offset += numel + GAP
    return torch.randn(offset, generator=torch.Generator().manual_seed(seed)), segments[::-1]


def grads_for(step: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + step)) * 1e-2


def hyper(**sgd: Any) -> OptimizerHyper:
    return OptimizerHyper(weight_decay=(), group=(), lrs=BASE_LRS, betas=GROUP_BETAS, eps=1e-8, **sgd)


RULES: dict[str, tuple[str, dict[str, Any]]] = {
    "adam": ("adam", {}),
    "lion": ("lion", {}),
    "sgd": ("sgd", {}),
    "sgd-momentum-dampening": ("sgd", {"momentum": 0.9, "dampening": 0.1}),
    "sgd-nesterov": ("sgd", {"momentum": 0.9, "nesterov": True}),
}


def torch_reference(name: str, sgd: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(groups, eps=1e-8, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(groups, foreach=False, **sgd)
    assert name == "lion"
    return PublishedLion(groups, betas=GROUP_BETAS[0])


def run_both(
    name: str, sgd: dict[str, Any], *, reference_kind: Callable[..., torch.optim.Optimizer] = torch_reference
) -> tuple[torch.Tensor, list[tuple[int, int, float, int]], list[nn.Parameter], list[int]]:
    """The rule's kernel over the shard and the reference over separate parameters, the same
    steps; the kernel's state is saved after step 3 and loaded into a fresh kernel that goes on."""
    master, segments = shard()
    rule = rule_named(name).for_momentum(sgd.get("momentum", 0.0))
    settings = hyper(**sgd)

    def build(values: torch.Tensor) -> Any:
        states = tuple(torch.zeros_like(values) for _ in rule.state_names)
        kernel = rule.build(values, segments, hyper=settings, states=states)
        if hasattr(kernel, "workspace_numel"):
            kernel = type(kernel)(values, segments, hyper=settings, states=states, workspace_numel=WORKSPACE)
        return kernel

    params = [nn.Parameter(master[start : start + numel].clone()) for start, numel, _, _ in segments]
    groups = [
        {"params": [param], "weight_decay": decay, "lr": BASE_LRS[group], "betas": GROUP_BETAS[group]}
        for param, (_, _, decay, group) in zip(params, segments, strict=True)
    ]
    reference = reference_kind(name, sgd, groups)
    kernel = build(master)
    for step, lr in enumerate(LRS):
        grad = grads_for(step, master.numel())
        active = [not inactive(step, index) for index in range(len(segments))]
        for param, (start, numel, _, _), on in zip(params, segments, active, strict=True):
            param.grad = grad[start : start + numel].clone() if on else None
        for group, (_, _, _, index) in zip(reference.param_groups, segments, strict=True):
            group["lr"] = BASE_LRS[index] if lr is None else (lr, 2 * lr)[index]
        reference.step()
        kernel.step_(grad, active, None if lr is None else (lr, 2 * lr))
        if step == 3:
            saved = kernel.state_dict()
            saved = {"segments": [{**entry} for entry in saved["segments"]]}
            for entry in saved["segments"]:
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in entry:
                        entry[key] = entry[key].clone()
                if "states" in entry:
                    entry["states"] = [state.clone() for state in entry["states"]]
            restored_master = master.clone()
            kernel = build(restored_master)
            kernel.load_state_dict(saved)
            master = restored_master
    return master, segments, params, kernel.step_counts()


@pytest.mark.parametrize("case", list(RULES))
def test_each_rule_over_a_shard_updates_as_its_reference_does_on_separate_parameters(case: str) -> None:
    name, sgd = RULES[case]
    master, segments, params, steps = run_both(name, sgd)
    for param, (start, numel, _, _) in zip(params, segments, strict=True):
        got = master[start : start + numel]
        if name == "lion":
            assert torch.equal(got, param.detach()), f"segment at {start}: Lion differs from the published rule"
        else:
            diff = (got - param.detach()).abs().max().item()
            assert diff <= RELATIVE_TOLERANCE * param.detach().abs().max().item(), f"segment at {start}: {diff:.3e}"
    reference_master, _ = shard()
    untouched = torch.ones_like(master, dtype=torch.bool)
    for start, numel, _, _ in segments:
        untouched[start : start + numel] = False
    assert torch.equal(master[untouched], reference_master[untouched]), "padding was written"
    assert steps == [len(LRS) - 1] * len(segments), "each segment missed one step"


def test_lion_stays_within_the_tolerance_of_the_lion_pytorch_package() -> None:
    """A second, independent Lion: lion-pytorch computes c and the moment with fused
    multiply-adds, so it may round differently; within DESIGN's tolerance all the same."""
    lion_pytorch = pytest.importorskip("lion_pytorch")

    def package(name: str, sgd: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer = lion_pytorch.Lion(groups, lr=1e-3, betas=GROUP_BETAS[0])
        return optimizer

    master, segments, params, _ = run_both("lion", {}, reference_kind=package)
    for param, (start, numel, _, _) in zip(params, segments, strict=True):
        diff = (master[start : start + numel] - param.detach()).abs().max().item()
        assert diff <= RELATIVE_TOLERANCE * param.detach().abs().max().item(), f"segment at {start}: {diff:.3e}"


def test_adam_is_bit_exact_against_torchs_fused_adam() -> None:
    """The shard's Adam is torch's fused kernel over views: the same bits as on separate parameters."""

    def fused(name: str, sgd: dict[str, Any], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return torch.optim.Adam(groups, eps=1e-8, fused=True)

    master, segments, params, _ = run_both("adam", {}, reference_kind=fused)
    for param, (start, numel, _, _) in zip(params, segments, strict=True):
        assert torch.equal(master[start : start + numel], param.detach()), f"segment at {start}"


@pytest.mark.parametrize("case", ["lion", "sgd-nesterov"])
def test_an_update_makes_temporaries_no_longer_than_the_batch_limit(case: str) -> None:
    """A persistent chunk's update runs on the device beside the model: its temporaries are
    bounded by the kernel's batch limit, not the shard (whatever the sizes of its segments)."""
    name, sgd = RULES[case]
    master, segments = shard()
    rule = rule_named(name).for_momentum(sgd.get("momentum", 0.0))
    states = tuple(torch.zeros_like(master) for _ in rule.state_names)
    kernel = rule.build(master, segments, hyper=hyper(**sgd), states=states)
    kernel = type(kernel)(master, segments, hyper=hyper(**sgd), states=states, workspace_numel=WORKSPACE)
    grad = grads_for(0, master.numel())
    largest: list[int] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(2):  # the first update (SGD: the buffer copy) and a later one
            kernel.step_(grad, [True] * len(segments))
    largest = [event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0]
    limit = 4 * WORKSPACE
    assert largest, "the update allocated nothing: the profiler saw no temporaries"
    assert max(largest) <= limit, f"a temporary of {max(largest)} bytes, the batch limit is {limit}"


def test_sgd_without_momentum_keeps_no_state_and_adafactor_is_refused_with_its_reason() -> None:
    sgd = rule_named("sgd")
    assert sgd.for_momentum(0.0).state_names == ()
    assert sgd.for_momentum(0.9).state_names == ("momentum_buffer",)
    assert rule_named("lion").state_names == ("exp_avg",)
    with pytest.raises(ValueError, match="row and column sums"):
        rule_named("adafactor")

"""ShardAdamW against torch.optim.AdamW on separate parameters: bit-exact against the fused
kernel, within DESIGN section 6's tolerance against the default for-loop implementation, with
per-segment weight decay, per-segment step counts and segments that get no gradient."""

from __future__ import annotations

import io
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from protrain.runtime.optim.adamw import ShardAdamW
from protrain.runtime.optim.shard import Segment
from tests.helpers import RELATIVE_TOLERANCE

BETAS = (0.9, 0.95)
EPS = 1e-8
BASE_LR = 1e-3
GAP = 5  # padding between segments and at the end of the shard, which no segment owns
# lr per step (None: the constructor's) and which segments get no gradient in that step.
LRS: tuple[float | None, ...] = (2e-3, None, 5e-4, 3e-3, 1e-3)
MIXED = ((22, 0.1), (1023, 0.0), (1 << 20, 0.1), (22, 0.0), (1023, 0.1))
LAYOUTS = {
    "mixed": MIXED,
    **{f"alone-{size}-wd{decay}": ((size, decay),) for size in (22, 1023, 1 << 20) for decay in (0.1, 0.0)},
}


def inactive(step: int, segment: int, num_segments: int) -> bool:
    """Segment 0 misses the first step (its state is still empty in torch then); the others
    each miss one step; a shard of one segment misses step 2."""
    if num_segments == 1:
        return step == 2
    return step == (segment % len(LRS))


def build_shard(layout: Sequence[tuple[int, float]], seed: int) -> tuple[torch.Tensor, list[Segment]]:
    """A flat master with the layout's segments separated by padding, listed in reverse memory
    order (the shard accepts any order)."""
    segments = []
    offset = GAP
    for numel, decay in layout:
        segments.append(Segment(offset, numel, decay))
        offset += numel + GAP
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(offset, generator=generator), segments[::-1]


def reference(
    master: torch.Tensor, segments: Sequence[Segment], *, fused: bool
) -> tuple[list[nn.Parameter], torch.optim.AdamW]:
    params = [nn.Parameter(master[s.start : s.start + s.numel].clone()) for s in segments]
    groups = [{"params": [p], "weight_decay": s.weight_decay} for p, s in zip(params, segments, strict=False)]
    kind = {"fused": True} if fused else {"foreach": False}
    return params, torch.optim.AdamW(groups, lr=BASE_LR, betas=BETAS, eps=EPS, **kind)


def torch_state(optimizer: torch.optim.AdamW, param: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor, int]:
    state = optimizer.state[param]
    if not state:  # never stepped: torch has not initialised it yet
        zeros = torch.zeros_like(param)
        return zeros, zeros, 0
    return state["exp_avg"], state["exp_avg_sq"], int(state["step"])


def shard_state(shard: ShardAdamW, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    segment = shard.segments[index]
    window = slice(segment.start, segment.start + segment.numel)
    return (
        shard.master[window],
        shard.exp_avg[window],
        shard.exp_avg_sq[window],
        shard.step_counts()[index],
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Per tensor: max|a - b| <= rtol * max|b| (DESIGN section 6)."""
    diff = torch.linalg.vector_norm(actual - expected, float("inf")).item()
    bound = RELATIVE_TOLERANCE * torch.linalg.vector_norm(expected, float("inf")).item()
    assert diff <= bound, f"{what}: max|a-b| = {diff:.3e} > {bound:.3e}"


def gradients(master: torch.Tensor, step: int) -> torch.Tensor:
    return torch.randn(master.numel(), generator=torch.Generator().manual_seed(1000 + step))


def active_flags(step: int, num_segments: int) -> list[bool]:
    return [not inactive(step, index, num_segments) for index in range(num_segments)]


def torch_step(
    params: list[nn.Parameter],
    optimizer: torch.optim.AdamW,
    segments: Sequence[Segment],
    grad_flat: torch.Tensor,
    active: list[bool],
    lr: float | None,
) -> None:
    for group in optimizer.param_groups:
        group["lr"] = BASE_LR if lr is None else lr
    for param, segment, is_active in zip(params, segments, active, strict=False):
        # Views, as the shard gets: neither AdamW writes to its gradients.
        param.grad = grad_flat[segment.start : segment.start + segment.numel] if is_active else None
    optimizer.step()


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_matches_torch_adamw(layout: Sequence[tuple[int, float]]) -> None:
    master, segments = build_shard(layout, seed=0)
    fused_params, fused = reference(master, segments, fused=True)
    loop_params, loop = reference(master, segments, fused=False)
    shard = ShardAdamW(master, segments, lr=BASE_LR, betas=BETAS, eps=EPS)
    for step, lr in enumerate(LRS):
        grad_flat = gradients(master, step)
        active = active_flags(step, len(segments))
        before = {i: [t.clone() for t in shard_state(shard, i)[:3]] for i, on in enumerate(active) if not on}
        steps_before = shard.step_counts()
        shard.step_(grad_flat, active, lr)
        torch_step(fused_params, fused, segments, grad_flat, active, lr)
        torch_step(loop_params, loop, segments, grad_flat, active, lr)
        for index, is_active in enumerate(active):
            value, exp_avg, exp_avg_sq, count = shard_state(shard, index)
            ref_avg, ref_avg_sq, ref_count = torch_state(fused, fused_params[index])
            what = f"step {step} segment {index}"
            assert torch.equal(value, fused_params[index].detach()), f"{what}: parameter"
            assert torch.equal(exp_avg, ref_avg), f"{what}: exp_avg"
            assert torch.equal(exp_avg_sq, ref_avg_sq), f"{what}: exp_avg_sq"
            assert count == ref_count == steps_before[index] + is_active, f"{what}: step count"
            if not is_active:
                assert all(
                    torch.equal(a, b)
                    for a, b in zip((value, exp_avg, exp_avg_sq), before[index], strict=False)
                )
    # Against the for-loop implementation once, at the end: differences only accumulate.
    for index in range(len(segments)):
        value, exp_avg, exp_avg_sq, _ = shard_state(shard, index)
        loop_avg, loop_avg_sq, _ = torch_state(loop, loop_params[index])
        assert_close(value, loop_params[index].detach(), f"segment {index}: parameter vs for-loop AdamW")
        assert_close(exp_avg, loop_avg, f"segment {index}: exp_avg vs for-loop AdamW")
        assert_close(exp_avg_sq, loop_avg_sq, f"segment {index}: exp_avg_sq vs for-loop AdamW")
    assert shard.step_counts() == [len(LRS) - 1] * len(segments), "each segment missed one step"


def test_writes_land_in_the_callers_tensors_and_padding_is_untouched() -> None:
    master, segments = build_shard(MIXED[:2], seed=1)
    original = master.clone()
    pointer = master.data_ptr()
    shard = ShardAdamW(master, segments, lr=BASE_LR)
    shard.step_(gradients(master, 0), [True, True])
    assert shard.master is master and master.data_ptr() == pointer
    owned = torch.zeros(master.numel(), dtype=torch.bool)
    for segment in segments:
        owned[segment.start : segment.start + segment.numel] = True
    assert not torch.equal(master[owned], original[owned])
    assert torch.equal(master[~owned], original[~owned])
    assert torch.count_nonzero(shard.exp_avg[~owned]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_out_mirrors_the_master(dtype: torch.dtype) -> None:
    master, segments = build_shard(MIXED, seed=2)
    shard = ShardAdamW(master, segments, lr=BASE_LR)
    copy = torch.full_like(master, float("nan"), dtype=dtype)
    for step, lr in enumerate(LRS[:3]):
        shard.step_(gradients(master, step), active_flags(step, len(segments)), lr, copy_out=copy)
        assert torch.equal(copy, master.to(dtype))


def test_state_dict_round_trip_continues_identically() -> None:
    master, segments = build_shard(MIXED, seed=3)
    shard = ShardAdamW(master, segments, lr=BASE_LR, betas=BETAS, eps=EPS)
    for step in range(3):
        shard.step_(gradients(master, step), active_flags(step, len(segments)), LRS[step])
    buffer = io.BytesIO()
    torch.save(shard.state_dict(), buffer)
    buffer.seek(0)
    restored = ShardAdamW(master.clone(), segments, lr=BASE_LR, betas=BETAS, eps=EPS)
    restored.load_state_dict(torch.load(buffer))
    assert restored.step_counts() == shard.step_counts()
    for step in range(3, len(LRS)):
        for each in (shard, restored):
            each.step_(gradients(master, step), active_flags(step, len(segments)), LRS[step])
    assert torch.equal(restored.master, shard.master)
    assert torch.equal(restored.exp_avg, shard.exp_avg)
    assert torch.equal(restored.exp_avg_sq, shard.exp_avg_sq)
    assert restored.step_counts() == shard.step_counts()


def test_state_of_another_layout_is_refused() -> None:
    master, segments = build_shard(MIXED, seed=4)
    state = ShardAdamW(master, segments, lr=BASE_LR).state_dict()
    with pytest.raises(ValueError, match="same chunk layout"):
        ShardAdamW(master.clone(), segments[:-1], lr=BASE_LR).load_state_dict(state)
    moved = [Segment(s.start, s.numel, 0.5) for s in segments]
    with pytest.raises(ValueError, match="same chunk layout"):
        ShardAdamW(master.clone(), moved, lr=BASE_LR).load_state_dict(state)


def test_shard_of_padding_only() -> None:
    master = torch.randn(8)
    shard = ShardAdamW(master, [], lr=BASE_LR)
    copy = torch.empty(8, dtype=torch.bfloat16)
    shard.step_(torch.randn(8), [], copy_out=copy)
    assert torch.equal(copy, master.to(torch.bfloat16)) and shard.state_dict() == {"segments": []}


@pytest.mark.parametrize(
    ("segments", "match"),
    [
        ([(0, 10, 0.0), (5, 10, 0.0)], "overlaps"),
        ([(60, 10, 0.0)], "inside the shard"),
        ([(0, 0, 0.0)], "inside the shard"),
        ([(0, 10, -0.1)], "weight_decay"),
    ],
)
def test_bad_segments_are_refused(segments: list[tuple[int, int, float]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShardAdamW(torch.zeros(64), segments, lr=BASE_LR)


def test_bad_step_inputs_are_refused() -> None:
    shard = ShardAdamW(torch.zeros(64), [(0, 32, 0.0), (32, 32, 0.1)], lr=BASE_LR)
    with pytest.raises(ValueError, match="2 segments"):
        shard.step_(torch.zeros(64), [True])
    with pytest.raises(ValueError, match="grad_flat"):
        shard.step_(torch.zeros(64, dtype=torch.bfloat16), [True, True])
    with pytest.raises(ValueError, match="copy_out"):
        shard.step_(torch.zeros(64), [True, True], copy_out=torch.zeros(63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="master"):
        ShardAdamW(torch.zeros(64, dtype=torch.bfloat16), [], lr=BASE_LR)

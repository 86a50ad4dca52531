"""The oracle of DESIGN section 6 (``tests.helpers.assert_matches_reference``) can fail: a real
error refuses, rounding noise in a tensor whose gradient is cancellation noise passes only within
the float64 run's floor, and the plain per-tensor tolerance is shown to be too strict for it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    TINY_GPT,
    assert_matches_reference,
    assert_state_close,
    gpt_reference,
    lm_batches,
    tiny_gpt,
    train_reference,
)

STEPS = 6
KEY = slice(TINY_GPT.d_model, 2 * TINY_GPT.d_model)  # the key part of the fused qkv bias
KEY_BIAS = "blocks.1.attn.qkv.bias"
ORDINARY = "blocks.0.mlp.fc.weight"


def perturbed(
    state: dict[str, torch.Tensor], name: str, index: slice, delta: float
) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with ``delta`` added to ``state[name][index]`` (the cached run stays)."""
    changed = dict(state)
    changed[name] = state[name].clone()
    changed[name][index] += delta
    return changed


def test_key_bias_is_noise_in_fp32_and_zero_in_float64() -> None:
    """Why the oracle needs a floor: softmax ignores the key bias, so its float64 gradient is
    zero to 1e-14 while fp32 rounding makes Adam move it by ~1e-5 (the bias starts at 0)."""
    run = gpt_reference(steps=STEPS, lr=1e-3, weight_decay=0.1)
    assert run.fp64[KEY_BIAS].dtype == torch.float64
    assert run.fp64[KEY_BIAS][KEY].abs().max() < 1e-10
    assert run.fp32[KEY_BIAS][KEY].abs().max() > 1e-7


def test_another_correct_fp32_run_breaks_the_tolerance_only_on_key_biases_and_passes_the_oracle() -> None:
    """torch's for-loop AdamW instead of its fused kernel: the same math, other rounding."""
    run = gpt_reference(steps=STEPS, lr=1e-3, weight_decay=0.1)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    other, _ = train_reference(tiny_gpt(), data, steps=STEPS, lr=1e-3, weight_decay=0.1, fused=False)
    with pytest.raises(AssertionError, match=r"attn\.qkv\.bias"):
        assert_state_close(other, run.fp32)
    beyond = {
        name
        for name, ref in run.fp32.items()
        if (other[name] - ref).abs().max() > 1e-5 * ref.abs().max()
    }
    assert beyond and all(name.endswith("attn.qkv.bias") for name in beyond), beyond
    assert_matches_reference(other, run.fp32, run.fp64)


def test_a_real_error_in_an_ordinary_tensor_is_refused() -> None:
    """A weight off by 1e-3 of its magnitude (far inside what training changed): the float64
    floor of an ordinary tensor is below the tolerance, so it cannot excuse the error."""
    run = gpt_reference(steps=STEPS, lr=1e-3, weight_decay=0.1)
    size = run.fp32[ORDINARY].abs().max().item()
    wrong = perturbed(run.fp32, ORDINARY, slice(0, 1), 1e-3 * size)
    with pytest.raises(AssertionError, match=rf"{ORDINARY}: .*float64 run does not explain it"):
        assert_matches_reference(wrong, run.fp32, run.fp64)


@pytest.mark.parametrize(("multiple", "accepted"), [(5.0, True), (20.0, False)])
def test_key_bias_noise_passes_only_within_ten_times_the_float64_floor(
    multiple: float, accepted: bool
) -> None:
    """The key bias moved by 5x (accepted) or 20x (refused) plain fp32 PyTorch's own distance
    from the float64 run: the floor is a bound, not a pass for the whole tensor."""
    run = gpt_reference(steps=STEPS, lr=1e-3, weight_decay=0.1)
    floor = (run.fp32[KEY_BIAS].double() - run.fp64[KEY_BIAS]).abs().max().item()
    moved = perturbed(run.fp32, KEY_BIAS, KEY, multiple * floor)
    if accepted:
        assert_matches_reference(moved, run.fp32, run.fp64)
    else:
        with pytest.raises(AssertionError, match=rf"{KEY_BIAS}: .*float64 run does not explain it"):
            assert_matches_reference(moved, run.fp32, run.fp64)

"""Two real gloo ranks: the engine equals plain PyTorch on the same global batches, every rank
ends with the same parameters, and skip/raise decisions are the same on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protrain.runtime.training.update import NonFiniteLossError
from tests.distributed.pool import RankPool, RemoteError
from tests.helpers import (
    assert_matches_reference,
    assert_state_close,
    assert_state_equal,
    gpt_reference,
    lm_batches,
    tiny_gpt,
    train_engine,
)

STEPS = 20


def _config(output_dir: str, accumulation: int, clip: float, scheduler: dict[str, Any]) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "scheduler": scheduler,
        "output_dir": output_dir,
    }


def run_training(
    *, rank: int, output_dir: str, accumulation: int, clip: float, scheduler: dict[str, Any], model_seed: int
) -> dict[str, Any]:
    data = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=2)
    # Rank 1 builds a different model on purpose: initialize must start every rank from rank 0's.
    state, losses = train_engine(
        tiny_gpt(model_seed + rank),
        data,
        _config(output_dir, accumulation, clip, scheduler),
        steps=STEPS,
        rank=rank,
    )
    return {"state": state, "losses": losses}


@pytest.mark.parametrize(
    ("accumulation", "clip", "scheduler"),
    [
        (1, 0.0, {"type": "constant"}),
        (4, 0.05, {"type": "warmup_cosine", "warmup_steps": 5, "total_steps": STEPS, "min_lr_ratio": 0.1}),
    ],
    ids=["accumulation-1", "accumulation-4-clip-cosine"],
)
def test_two_ranks_match_plain_pytorch(
    rank_pool: RankPool, tmp_path: Path, accumulation: int, clip: float, scheduler: dict[str, Any]
) -> None:
    results = rank_pool.run(
        run_training,
        output_dir=str(tmp_path),
        accumulation=accumulation,
        clip=clip,
        scheduler=scheduler,
        model_seed=0,
    )
    assert_state_equal(results[1]["state"], results[0]["state"])
    reference = gpt_reference(
        accumulation=accumulation,
        world_size=2,
        steps=STEPS,
        lr=1e-3,
        weight_decay=0.1,
        clip=clip,
        warmup_cosine=None if scheduler["type"] == "constant" else (5, STEPS, 0.1),
    )
    # Thread counts differ: rounding only, which Adam amplifies in the key biases (float64 floor).
    assert_matches_reference(results[0]["state"], reference.fp32, reference.fp64)
    # Each rank reports its own micro-batches' loss; their mean is the global loss.
    mean_losses = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"], strict=True)]
    assert mean_losses == pytest.approx(reference.losses, rel=1e-5)


OFFLOAD = pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
"""Every chunk on the device, or every chunk offloaded (their CPU Adam updates early, during the
last backward, which a skip or another rank's gradient must not get wrong)."""


def _memory(offload: bool) -> dict[str, Any]:
    return {"memory": {"n_persist": 0}} if offload else {}


def nonfinite_on_rank_one(*, rank: int, output_dir: str, policy: str, offload: bool) -> dict[str, Any]:
    from protrain import runtime

    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "on_nonfinite_loss": policy,
        "output_dir": output_dir,
        **_memory(offload),
    }
    engine = runtime.initialize(tiny_gpt(0), config=config)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    before = engine.state_dict()
    out = engine(**data.batch(0, 0, rank))
    engine.backward(out.loss * (float("nan") if rank == 1 else 1.0))
    try:
        updated = engine.step()
    except NonFiniteLossError as err:
        engine.close()
        return {"raised": str(err)}
    unchanged = all(torch.equal(before[k], v) for k, v in engine.state_dict().items())
    out = engine(**data.batch(1, 0, rank))
    engine.backward(out.loss)
    engine.step()
    result = {
        "updated": updated,
        "unchanged": unchanged,
        "early_updates": engine.chunks.num_speculations,
        "global_step": engine.global_step,
        "skipped": engine.skipped_steps,
        "state": engine.state_dict(),
    }
    engine.close()
    return result


@pytest.mark.skips_steps
@OFFLOAD
def test_nonfinite_loss_on_one_rank_is_skipped_on_both(
    rank_pool: RankPool, tmp_path: Path, offload: bool
) -> None:
    results = rank_pool.run(nonfinite_on_rank_one, output_dir=str(tmp_path), policy="skip", offload=offload)
    for result in results:
        assert result["updated"] is False and result["unchanged"]
        assert (result["global_step"], result["skipped"]) == (1, 1)
        if offload:  # the skipped step updated nothing early; the next one did
            assert 0 < result["early_updates"] == results[0]["early_updates"]
    assert_state_equal(results[1]["state"], results[0]["state"])


def test_nonfinite_loss_on_one_rank_raises_on_both(rank_pool: RankPool, tmp_path: Path) -> None:
    results = rank_pool.run(nonfinite_on_rank_one, output_dir=str(tmp_path), policy="raise", offload=True)
    assert all("non-finite loss in 1 of 2 micro-batches" in r["raised"] for r in results)


def branch_on_rank_zero_only(*, rank: int, output_dir: str, offload: bool) -> dict[str, torch.Tensor]:
    """A parameter that gets a gradient on rank 0 only, and one that gets none anywhere."""
    from torch import nn

    from protrain import runtime

    torch.manual_seed(5)
    model = nn.ModuleDict({"trunk": nn.Linear(4, 4), "branch": nn.Linear(4, 4), "never": nn.Linear(4, 4)})
    config = {"seed": 1, "optimizer": {"lr": 0.1, "weight_decay": 0.1}, "output_dir": output_dir}
    engine = runtime.initialize(model, config={**config, **_memory(offload)})
    torch.manual_seed(10 + rank)
    x = torch.randn(3, 4)
    for _ in range(3):
        h = model["trunk"](x)
        if rank == 0:
            h = model["branch"](h)
        engine.backward(h.square().mean())
        engine.step()
    state = engine.state_dict()
    engine.close()
    return state


@OFFLOAD
def test_parameter_used_on_one_rank_only(rank_pool: RankPool, tmp_path: Path, offload: bool) -> None:
    results = rank_pool.run(branch_on_rank_zero_only, output_dir=str(tmp_path), offload=offload)
    assert_state_equal(results[1], results[0])
    torch.manual_seed(5)
    from torch import nn

    model = nn.ModuleDict({"trunk": nn.Linear(4, 4), "branch": nn.Linear(4, 4), "never": nn.Linear(4, 4)})
    initial_never = {k: v.clone() for k, v in model["never"].state_dict().items()}
    optimizer = torch.optim.AdamW(
        [
            {"params": [m.weight for m in model.values()], "weight_decay": 0.1},
            {"params": [m.bias for m in model.values()], "weight_decay": 0.0},
        ],
        lr=0.1,
        betas=(0.9, 0.95),
    )
    inputs = []
    for rank in range(2):
        torch.manual_seed(10 + rank)
        inputs.append(torch.randn(3, 4))
    for _ in range(3):
        losses = [
            model["branch"](model["trunk"](inputs[0])).square().mean(),
            model["trunk"](inputs[1]).square().mean(),
        ]
        ((losses[0] + losses[1]) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_state_close(results[0], {k: v.detach() for k, v in model.state_dict().items()})
    # No gradient anywhere: AdamW skips it entirely (no weight decay either).
    assert torch.equal(results[0]["never.weight"], initial_never["weight"])


def failing_body(*, rank: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on rank 1")


@pytest.mark.skips_steps
def test_pool_reports_a_failing_rank_and_recovers(rank_pool: RankPool, tmp_path: Path) -> None:
    with pytest.raises(RemoteError, match="boom on rank 1"):
        rank_pool.run(failing_body)
    results = rank_pool.run(nonfinite_on_rank_one, output_dir=str(tmp_path), policy="skip", offload=False)
    assert len(results) == 2


def run_offloaded(
    *, rank: int, output_dir: str, accumulation: int, clip: float, n_persist: int, n_buffer: int
) -> dict[str, Any]:
    config = _config(output_dir, accumulation, clip, {"type": "constant"})
    config["memory"] = {"chunk_size": "64KiB", "n_persist": n_persist, "n_buffer": n_buffer}
    data = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=2)
    state, losses = train_engine(tiny_gpt(0), data, config, steps=8, rank=rank)
    return {"state": state, "losses": losses}


@pytest.mark.parametrize(
    ("n_persist", "n_buffer", "accumulation", "clip"),
    [(0, 2, 1, 0.0), (5, 3, 4, 0.05)],
    ids=["all-offloaded-min-buffers", "some-persistent-accumulation-clip"],
)
def test_two_ranks_with_offloaded_chunks_match_plain_pytorch(
    rank_pool: RankPool, tmp_path: Path, n_persist: int, n_buffer: int, accumulation: int, clip: float
) -> None:
    results = rank_pool.run(
        run_offloaded,
        output_dir=str(tmp_path),
        accumulation=accumulation,
        clip=clip,
        n_persist=n_persist,
        n_buffer=n_buffer,
    )
    assert_state_equal(results[1]["state"], results[0]["state"])
    reference = gpt_reference(
        accumulation=accumulation, world_size=2, steps=8, lr=1e-3, weight_decay=0.1, clip=clip
    )
    assert_matches_reference(results[0]["state"], reference.fp32, reference.fp64)


def fp16_overflow_on_rank_one(*, rank: int, output_dir: str) -> dict[str, Any]:
    from protrain import runtime

    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "precision": "fp16",
        "output_dir": output_dir,
        "loss_scaling": {"initial": 1024.0, "growth_interval": 1000, "min_scale": 1.0},
        "memory": {"chunk_size": "64KiB", "n_persist": 2, "n_buffer": 2},
    }
    engine = runtime.initialize(tiny_gpt(0), config=config)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    updated = []
    for update in range(4):
        loss = engine(**data.batch(update, 0, rank)).loss
        if update == 2 and rank == 1:
            loss = loss * 1e30  # overflows this rank's fp16 gradients in this step only
        engine.backward(loss)
        updated.append(engine.step())
    assert engine.loss_scaler is not None
    result = {"updated": updated, "scale": engine.loss_scaler.scale, "state": engine.state_dict()}
    engine.close()
    return result


@pytest.mark.skips_steps
def test_fp16_overflow_on_one_rank_skips_that_step_on_every_rank(rank_pool: RankPool, tmp_path: Path) -> None:
    results = rank_pool.run(fp16_overflow_on_rank_one, output_dir=str(tmp_path))
    for result in results:
        assert result["updated"] == [True, True, False, True]
        assert result["scale"] == 512.0
    assert_state_equal(results[1]["state"], results[0]["state"])

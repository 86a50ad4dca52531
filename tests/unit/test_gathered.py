"""A parameter read outside the forward of the module that owns it (TRL's fused loss, a callback,
a regularizer in the loss): with its chunk offloaded the read is refused, naming the parameter and
the fix, instead of computing on the placeholder; inside ``engine.gathered`` it reads its values,
and a differentiable use trains exactly as plain PyTorch (its gradient takes its chunk's
reduce-scatter path). ``modify=True`` keeps what the block wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.runtime.chunks.released import ReleasedParameterError
from tests.helpers import assert_state_close, lm_batches, reference_param_groups, tiny_gpt

STEPS = 4
LR, WEIGHT_DECAY, PENALTY = 1e-3, 0.1, 1e-2
READ = "blocks.0.mlp.proj.weight"  # a chunk in the middle: offloaded, evicted after its block


def job(tmp_path: Path) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": LR, "weight_decay": WEIGHT_DECAY},
        "memory": {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2},
        "output_dir": str(tmp_path / "runs"),
    }


def penalized(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return loss + PENALTY * (weight**2).sum()


def test_a_gathered_weight_in_the_loss_trains_as_plain_pytorch(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    plain = tiny_gpt()
    optimizer = torch.optim.AdamW(reference_param_groups(plain, WEIGHT_DECAY), lr=LR, betas=(0.9, 0.95), fused=True)
    for update in range(STEPS):
        penalized(plain(**data.batch(update, 0, 0)).loss, plain.get_parameter(READ)).backward()
        optimizer.step()
        optimizer.zero_grad()

    with runtime.initialize(tiny_gpt(), config=job(tmp_path)) as engine:
        weight = engine.module.get_parameter(READ)
        chunk = engine.chunks.store.chunk_of(weight)
        for update in range(STEPS):
            out = engine(**data.batch(update, 0, 0))
            assert chunk not in engine.chunks.resident_chunks(), "the test reads a chunk forward let go"
            with engine.gathered([weight]):
                loss = penalized(out.loss, weight)
            engine.backward(loss)
            engine.step()
        assert_state_close(engine.state_dict(), {k: v.detach() for k, v in plain.state_dict().items()})


def test_a_released_parameter_refuses_reads_naming_itself_and_the_fix(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with runtime.initialize(tiny_gpt(), config=job(tmp_path)) as engine:
        weight = engine.module.get_parameter(READ)
        out = engine(**data.batch(0, 0, 0))
        refused = rf"^{READ} was read \(\w+\) while its chunk is off the device.*engine\.gathered"
        with pytest.raises(ReleasedParameterError, match=refused):  # in the loss
            penalized(out.loss, weight)
        with pytest.raises(ReleasedParameterError, match=refused):  # through .data
            weight.data.sum()
        with pytest.raises(ReleasedParameterError, match=refused):  # through .data, in a list
            torch.cat([weight.data, weight.data])
        with pytest.raises(ReleasedParameterError, match=refused):  # as a logging callback would
            float(weight.norm())
        # Its metadata is there, and the values inside a gathered block.
        assert weight.shape == weight.data.shape == (64, 256) and weight.numel() == 64 * 256
        assert weight.requires_grad and weight.dtype == torch.float32
        with engine.gathered([weight]):
            inside = weight.detach().clone()
        assert torch.equal(inside, engine.state_dict()[READ])
        assert torch.isfinite(inside).all()


def test_modify_keeps_what_the_block_wrote_and_a_plain_block_writes_nothing_back(tmp_path: Path) -> None:
    with runtime.initialize(tiny_gpt(), config=job(tmp_path)) as engine:
        weight = engine.module.get_parameter(READ)
        chunk = engine.chunks.store.chunk_of(weight)
        before = engine.state_dict()[READ]
        with engine.gathered([weight]):
            weight.data.fill_(1.0)  # not kept: the master shard still holds the old values
        engine.chunks.evict(chunk)
        assert torch.equal(engine.state_dict()[READ], before)
        with engine.gathered([weight], modify=True):
            weight.data.mul_(2.0)
        engine.chunks.evict(chunk)
        assert torch.equal(engine.state_dict()[READ], before * 2)
        with pytest.raises(ValueError, match="not parameters of the engine's model"):
            with engine.gathered([torch.nn.Parameter(torch.zeros(2))]):
                pass

"""An optimizer is a rule (runtime/optim/): adding one is its kernel and one registration. A
test-only rule, sign SGD with decoupled weight decay (``p <- p * (1 - lr * wd) - lr * sign(g)``,
no state), is registered from this file alone and trains the tiny GPT on the host path (offloaded
chunks, the host worker) and the device path (persistent chunks) exactly as the same rule
written over the parameters of a plain PyTorch model. The host memory the chunks map shrinks by
AdamW's two moments per offloaded parameter, as the planner counts it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.profiler.host_bytes import chunk_state_bytes, rank_numel, region_bytes
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.optim.registry import register
from protrain.runtime.optim.rule import OptimizerHyper, OptimizerRule
from protrain.runtime.optim.shard import GroupValues, Segment, per_group
from tests.helpers import assert_state_equal, lm_batches, tiny_gpt, train_updates

LR, WEIGHT_DECAY, STEPS = 1e-3, 0.01, 3


class ShardSignSGD:
    """The rule's kernel over one flat shard (runtime/optim/shard.py's contract)."""

    def __init__(
        self,
        master: torch.Tensor,
        segments: Sequence[tuple[int, int, float, int]],
        *,
        hyper: OptimizerHyper,
        states: tuple[torch.Tensor, ...],
    ) -> None:
        self.master = master
        self.segments = tuple(Segment(*segment) for segment in segments)
        self.lrs = tuple(hyper.lrs)
        self.steps = torch.zeros(len(self.segments), dtype=torch.float32, device=master.device)

    @property
    def states(self) -> tuple[torch.Tensor, ...]:
        return ()

    @torch.no_grad()
    def step_(
        self,
        grad_flat: torch.Tensor,
        active: Sequence[bool],
        lr: GroupValues | None = None,
        *,
        copy_out: torch.Tensor | None = None,
    ) -> None:
        lrs = self.lrs if lr is None else per_group(lr, len(self.lrs), "lr")
        for index, (segment, on) in enumerate(zip(self.segments, active, strict=True)):
            if on:
                rate = lrs[segment.group]
                param = self.master.narrow(0, segment.start, segment.numel)
                param.mul_(1 - rate * segment.weight_decay)
                param.add_(torch.sign(grad_flat.narrow(0, segment.start, segment.numel)), alpha=-rate)
                self.steps[index] += 1
        if copy_out is not None:
            copy_out.copy_(self.master)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps.copy_(state["steps"])


SIGN_SGD = register(OptimizerRule(name="sign_sgd", state_names=(), kernel=ShardSignSGD, reference="sign SGD"))


def job(tmp_path: Path, **memory: Any) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"type": "sign_sgd", "lr": LR, "weight_decay": WEIGHT_DECAY, "no_decay": []},
        "memory": {"chunk_size": "64KiB", **memory},
        "output_dir": str(tmp_path / "runs"),
    }


def reference(steps: int) -> dict[str, torch.Tensor]:
    """The rule over a plain PyTorch model's parameters (one micro-batch per update)."""
    model = tiny_gpt()
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    for update in range(steps):
        model(**data.batch(update, 0, 0)).loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1 - LR * WEIGHT_DECAY)
                param.add_(torch.sign(param.grad), alpha=-LR)
                param.grad = None
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize(
    ("n_persist", "n_buffer"), [(0, 2), (12, 0)], ids=["host-path-all-offloaded", "device-path-all-persistent"]
)
@pytest.mark.parametrize("accumulation", [1, 2], ids=["on-arrival", "kept-gradients"])
def test_a_rule_registered_from_one_file_trains_like_its_reference(
    tmp_path: Path, n_persist: int, n_buffer: int, accumulation: int
) -> None:
    """Accumulation 2 keeps each offloaded gradient until the step (early updates on the host
    worker); 1 applies each as it arrives. With two micro-batches of the same batch the window's
    gradient is that batch's: the reference's update."""
    config = job(tmp_path, n_persist=n_persist, n_buffer=n_buffer)
    config["gradient_accumulation_steps"] = accumulation
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        assert engine.chunks.optimizer_rule is SIGN_SGD
        for update in range(STEPS):
            for _ in range(accumulation):
                out = engine(**data.batch(update, 0, 0))
                engine.backward(out.loss)
                engine.step()
        if n_persist == 0:
            assert engine.chunks.optimizer.num_speculations > 0, "the host worker updated the offloaded chunks"
        state = engine.state_dict()
    assert_state_equal(state, reference(STEPS))


def test_the_host_arena_holds_the_rules_state_as_the_planner_counts_it(tmp_path: Path) -> None:
    """No state: an offloaded trainable chunk maps its master and (accumulation 2) its gradient,
    two fp32 tensors instead of AdamW's four: the arena is exactly the region profiler/host_bytes
    counts for the rule (the count the cost model and the plan checks use)."""
    config = job(tmp_path, n_persist=0, n_buffer=2)
    config["gradient_accumulation_steps"] = 2
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        layout, arena = engine.chunks.layout, engine.chunks.host_arena
        assert arena is not None

        def region(optimizer_states: int) -> int:
            payload = sum(
                chunk_state_bytes(
                    rank_numel(info.used, layout.shard_numel, 0),
                    trainable=info.trainable,
                    element_size=4,
                    keeps_gradients=True,
                    optimizer_states=optimizer_states,
                )
                for info in layout.chunks
            )
            return region_bytes(payload)

        assert arena.capacity_bytes == region(0) < region(2)
        assert all(len(chunk.state_tensors()) == 1 for chunk in engine.chunks.chunks)


def test_a_name_no_rule_has_is_refused_naming_the_registered_ones(tmp_path: Path) -> None:
    config = job(tmp_path)
    config["optimizer"]["type"] = "lamb"
    with pytest.raises(SpecError, match=r"optimizer.type: got 'lamb' .*allowed: one of adamw"):
        runtime.initialize(tiny_gpt(), config=config)

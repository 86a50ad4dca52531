"""Chunks packed in the order a model uses its parameters, also when ``initialize`` had no example
batch to learn it from (the Hugging Face Trainer's way): module order is only a start."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.runtime.chunks.layout import first_use_order
from tests.helpers import TINY_LLAMA, adamw_decaying_by_name, assert_state_equal, lm_batches

transformers = pytest.importorskip("transformers")


def test_a_model_planned_on_its_first_batch_is_packed_in_its_order_of_use(tmp_path: Path) -> None:
    """Llama registers each layer's norms after its MLP. Packed in that order, a chunk holding a
    layer's norms and the next layer's attention stays incomplete until backward reaches the
    norms, and since reductions go in a fixed order the chunks after it wait with their gradient
    buffers: 4 at once here, 4 of 32 MiB on a 16-layer Llama, where the plan counts 1 (the device
    wall caught the overrun). Planned on its first batch, the engine packs by the order of use,
    so one buffer fills at a time and none waits; the training equals plain PyTorch."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    reference = copy.deepcopy(model)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1, seq_len=16)
    batches = [data.batch(update, 0, 0) for update in range(3)]
    probe = copy.deepcopy(model)
    in_use = first_use_order(probe, lambda: probe(**batches[0]))
    registered = [name for name, _ in model.named_parameters()]
    assert in_use != registered, "the model must list its parameters out of their order of use"
    config: dict[str, Any] = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"chunk_size": "64KiB", "n_persist": 0},
        "output_dir": str(tmp_path),
    }
    optimizer = adamw_decaying_by_name(reference, ("bias", "norm", "ln"))  # the spec's default rule
    with runtime.initialize(model, config=config) as engine:
        filling: list[int] = []  # after each gradient's hook (the engine's runs first)
        for param in engine.module.parameters():
            param.register_post_accumulate_grad_hook(lambda _: filling.append(engine.chunks.reducer.buffers_filling()))
        for batch in batches:
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
            reference(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert engine.plan.rule.startswith("planned on a batch"), engine.plan.rule
        assert [info.name for info in engine.chunks.layout.params] == in_use
        # Buffers still taking gradients or waiting for an earlier chunk's (how many are being
        # reduced meanwhile depends on the side stream's pace, not on the packing).
        assert filling and max(filling) <= 1
        assert_state_equal(engine.state_dict(), {k: v.detach() for k, v in reference.state_dict().items()})

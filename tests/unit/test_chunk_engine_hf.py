"""The chunk engine on Hugging Face models built from config objects (no downloads): tiny GPT-2
(tied embeddings) and Llama, with offloaded chunks, a frozen layer, bit-exact with plain PyTorch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from protrain import runtime
from tests.helpers import TINY_LLAMA, adamw_decaying_by_name, assert_state_equal, lm_batches

transformers = pytest.importorskip("transformers")


def tiny_hf(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=256,
            n_positions=32,
            n_embd=64,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))


def reference_step_all(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    optimizer = adamw_decaying_by_name(model, ("bias", "norm", "ln"))
    for batch in batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_with_offloaded_chunks_and_a_frozen_layer(tmp_path: Path, kind: str) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1, seq_len=16)
    batches = [data.batch(update, 0, 0) for update in range(5)]
    reference = tiny_hf(kind)
    model = tiny_hf(kind)
    frozen = "transformer.h.0.mlp" if kind == "gpt2" else "model.layers.0.mlp"
    reference.get_submodule(frozen).requires_grad_(False)
    model.get_submodule(frozen).requires_grad_(False)
    # The spec's default patterns; HF names its norms ln_1 / input_layernorm ("norm" matches the
    # latter's name and both modules' class names).
    expected = reference_step_all(reference, batches)
    config: dict[str, Any] = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"chunk_size": "64KiB", "n_persist": 1, "n_buffer": 3},
        "output_dir": str(tmp_path / "runs"),
    }
    engine = runtime.initialize(model, config=config, example_batch=batches[0])
    assert engine.plan.num_chunks > 4
    for batch in batches:
        engine.backward(engine(**batch).loss)
        engine.step()
    assert_state_equal(engine.state_dict(), expected)
    engine.close()

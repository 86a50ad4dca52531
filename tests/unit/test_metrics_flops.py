"""Model FLOPs per token (runtime/observability/flops.py) hand-checked against torchtitan's formula,
6 * (N - N_embedding) + 12 * L * H * Q * T, on the tiny GPT and a tiny Hugging Face Llama, with
frozen parameters at 4; and the peak FLOPS table MFU divides by (runtime/observability/peak_flops.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from protrain.runtime.blocks import find_blocks
from protrain.runtime.chunks.layout import model_params
from protrain.runtime.config.spec import Precision
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.observability.flops import ModelFlops, model_flops
from protrain.runtime.observability.peak_flops import PEAK_TFLOPS_ENV, compute_dtype_name, peak_flops, table_tflops
from tests.helpers import TINY_GPT, TINY_LLAMA, tiny_gpt

CPU = DeviceInfo(torch.device("cpu"), "gloo")


def flops_of(model: nn.Module) -> ModelFlops:
    return model_flops(model, model_params(model), find_blocks(model, None)[1])


def gpt_block_params(d: int, mlp: int) -> int:
    """One GPT block by hand: two LayerNorms, qkv and output projections (with biases), the MLP."""
    norms = 2 * 2 * d
    attention = (d * 3 * d + 3 * d) + (d * d + d)
    feed_forward = (d * mlp * d + mlp * d) + (mlp * d * d + d)
    return norms + attention + feed_forward


def test_tiny_gpt_by_hand() -> None:
    c = TINY_GPT
    flops = flops_of(tiny_gpt())
    # The head shares the token embedding: its matmul is real (vocab * width per token), so that
    # weight counts; the learned positions are only looked up.
    blocks = c.n_layer * gpt_block_params(c.d_model, c.mlp_ratio)
    non_embedding = c.vocab_size * c.d_model + blocks + 2 * c.d_model  # the head, the blocks, ln_f
    assert flops.trainable_params == non_embedding
    assert flops.embedding_params == c.seq_len * c.d_model
    assert flops.frozen_params == 0
    assert (flops.layers, flops.heads, flops.head_dim) == (c.n_layer, c.n_head, c.d_model // c.n_head)
    assert flops.attention_missing is None
    head_dim = c.d_model // c.n_head
    assert flops.per_token(32) == 6 * non_embedding + 12 * c.n_layer * c.n_head * head_dim * 32
    # An update's FLOPs: tokens times the per-token count at the mean sequence length.
    assert flops.per_update(tokens=4 * 16, samples=4) == 4 * 16 * flops.per_token(16)
    assert flops.per_update(tokens=0, samples=0) == 0.0


def test_counts_agree_with_the_model_itself() -> None:
    """Independent of the layout's names and aliases: every parameter once, less wpe."""
    model = tiny_gpt()
    flops = flops_of(model)
    assert flops.trainable_params + flops.embedding_params == sum(p.numel() for p in model.parameters())
    assert flops.embedding_params == model.wpe.weight.numel()


def test_tiny_llama_by_hand() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**TINY_LLAMA)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    d, heads = TINY_LLAMA["hidden_size"], TINY_LLAMA["num_attention_heads"]
    kv_heads, inner = TINY_LLAMA["num_key_value_heads"], TINY_LLAMA["intermediate_size"]
    vocab, layers = TINY_LLAMA["vocab_size"], TINY_LLAMA["num_hidden_layers"]
    head_dim = d // heads
    layer = 2 * d * d + 2 * d * kv_heads * head_dim + 3 * d * inner + 2 * d  # q, o; k, v; MLP; norms
    non_embedding = layers * layer + d + vocab * d  # the final norm, the (untied) head
    flops = flops_of(model)
    assert flops.embedding_params == vocab * d
    assert flops.trainable_params == non_embedding
    # Grouped-query attention: the scores and weighted values run over every query head.
    assert (flops.layers, flops.heads, flops.head_dim) == (layers, heads, head_dim)
    assert flops.per_token(32) == 6 * non_embedding + 12 * layers * heads * head_dim * 32
    # Without the top-level config (a wrapper, a composite model's sub-config), the attention
    # modules' own config still says.
    wrapper = nn.Sequential(model)
    assert not hasattr(wrapper, "config")
    assert flops_of(wrapper).per_token(32) == flops.per_token(32)


def test_frozen_parameters_count_four() -> None:
    """Forward (2) and the input gradient (2), no weight gradient: a LoRA base's cost."""
    model = tiny_gpt()
    for block in model.blocks:
        block.mlp.requires_grad_(False)
    frozen = sum(p.numel() for block in model.blocks for p in block.mlp.parameters())
    trainable = flops_of(tiny_gpt()).trainable_params - frozen
    flops = flops_of(model)
    assert (flops.trainable_params, flops.frozen_params) == (trainable, frozen)
    assert flops.dense_per_token == 6 * trainable + 4 * frozen


class Heads(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attn = attention
        self.mlp = nn.Linear(32, 32)


def test_heads_found_on_blocks_without_a_config() -> None:
    model = nn.Sequential(nn.ModuleList(Heads(nn.MultiheadAttention(32, num_heads=4)) for _ in range(3)))
    flops = flops_of(model)
    assert (flops.layers, flops.heads, flops.head_dim) == (3, 4, 8)


def test_heads_not_found_leaves_the_attention_term_out() -> None:
    model = nn.Sequential(nn.ModuleList(Heads(nn.Linear(32, 32)) for _ in range(3)))
    flops = flops_of(model)
    assert flops.heads is None and flops.attention_missing is not None
    assert "Sequential" in flops.attention_missing
    assert flops.per_token(128) == flops.dense_per_token == 6 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("device_name", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "fp16", 121.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("NVIDIA GeForce RTX 3090", "fp16", 71.0),
        ("NVIDIA GeForce RTX 3090 Ti", "fp16", None),  # a different card, not guessed
        ("NVIDIA A10G", "bf16", None),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on Volta
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ],
)
def test_peak_table(device_name: str, dtype: str, expected: float | None) -> None:
    found = table_tflops(device_name, dtype)
    assert (None if found is None else found[1]) == expected


def test_compute_dtype() -> None:
    assert compute_dtype_name(Precision.BF16, tf32=True) == "bf16"
    assert compute_dtype_name(Precision.FP32, tf32=True) == "tf32"
    assert compute_dtype_name(Precision.FP32, tf32=False) == "fp32"


def test_peak_on_cpu_only_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    assert peak_flops(CPU, Precision.FP32).tflops is None
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "1.5")
    assert peak_flops(CPU, Precision.FP32).tflops == 1.5
    for bad in ("fast", "0", "-2", "inf", "nan"):
        monkeypatch.setenv(PEAK_TFLOPS_ENV, bad)
        with pytest.raises(ValueError, match=PEAK_TFLOPS_ENV):
            peak_flops(CPU, Precision.FP32)

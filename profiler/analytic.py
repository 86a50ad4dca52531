"""A model profile from a configuration alone, for what-if planning on hardware that is not here.

Decoder-only transformers (GPT-2 style: biases, LayerNorm, learned positions; Llama style: gated
MLP, RMSNorm, no biases, grouped-query attention), described by a Hugging Face ``config.json``
or the repo's GPT config. Parameters are listed in execution order with their block; times come
from FLOPs at a sustained rate; saved activations per block from Korthikanti et al. (2022),
"Reducing Activation Recomputation in Large Transformer Models": ``s*b*h*34`` bytes per layer in
16-bit precision with a fused attention kernel (no ``5*a*s/h`` term: the score matrix is not
stored). Backward is twice the forward. The transient peak is the logits in fp32 with their
gradient (the loss's working set), which dominates at large vocabularies.

Pure: no torch, nothing of ours but the profile types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from protrain.profiler.profile import BlockProfile, ModelProfile

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    # Published shapes, usable by name where a config.json is expected.
    "llama-2-7b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "llama-2-70b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
    },
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_positions: int
    gated_mlp: bool
    """Llama style: gate, up and down projections; else GPT-2 style fc and proj."""
    biases: bool
    learned_positions: bool
    tied_embeddings: bool
    norm_params: int
    """Parameters per normalisation layer per hidden unit: 2 (LayerNorm) or 1 (RMSNorm)."""

    @property
    def parameters(self) -> int:
        return sum(numel for numel, _, _ in parameter_list(self))


def shape_from_config(config: dict[str, Any], *, name: str = "model") -> TransformerShape:
    """A Hugging Face ``config.json`` (GPT-2, Llama, Mistral, Qwen2 families) or the repo's GPT
    config (``d_model``, ``n_layer``, ``n_head``, ``vocab_size``, ``seq_len``)."""

    def first(*keys: str, default: Any = None) -> Any:
        for key in keys:
            if key in config and config[key] is not None:
                return config[key]
        if default is None:
            raise ValueError(f"the model config has none of {', '.join(keys)}")
        return default

    model_type = str(config.get("model_type", "gpt2" if "n_embd" in config or "d_model" in config else ""))
    llama_like = model_type in {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"} or (
        "intermediate_size" in config and "n_embd" not in config
    )
    hidden = int(first("hidden_size", "n_embd", "d_model"))
    heads = int(first("num_attention_heads", "n_head"))
    return TransformerShape(
        name=name,
        layers=int(first("num_hidden_layers", "n_layer")),
        hidden=hidden,
        heads=heads,
        kv_heads=int(first("num_key_value_heads", default=heads)),
        ffn=int(first("intermediate_size", "n_inner", default=int(config.get("mlp_ratio", 4)) * hidden)),
        vocab=int(first("vocab_size")),
        max_positions=int(first("max_position_embeddings", "n_positions", "seq_len", default=2048)),
        gated_mlp=llama_like,
        biases=not llama_like and bool(config.get("qkv_bias", True)),
        learned_positions=not llama_like,
        tied_embeddings=bool(first("tie_word_embeddings", "tie_embeddings", default=not llama_like)),
        norm_params=1 if llama_like else 2,
    )


def parameter_list(shape: TransformerShape) -> list[tuple[int, int, str]]:
    """(numel, block index or -1, name) of every parameter, in execution order."""
    h, kv_dim = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    params: list[tuple[int, int, str]] = [(shape.vocab * h, -1, "embed_tokens")]
    if shape.learned_positions:
        params.append((shape.max_positions * h, -1, "embed_positions"))
    bias = shape.biases
    for layer in range(shape.layers):
        block: list[tuple[int, str]] = [(shape.norm_params * h, "norm_1")]
        block.append((h * (h + 2 * kv_dim) + (h + 2 * kv_dim if bias else 0), "qkv"))
        block.append((h * h + (h if bias else 0), "attn_out"))
        block.append((shape.norm_params * h, "norm_2"))
        if shape.gated_mlp:
            block += [(h * shape.ffn, "gate"), (h * shape.ffn, "up"), (shape.ffn * h, "down")]
        else:
            block += [
                (h * shape.ffn + (shape.ffn if bias else 0), "fc"),
                (shape.ffn * h + (h if bias else 0), "proj"),
            ]
        params += [(numel, layer, f"layers.{layer}.{name}") for numel, name in block]
    params.append((shape.norm_params * h, -1, "final_norm"))
    if not shape.tied_embeddings:
        params.append((shape.vocab * h, -1, "lm_head"))
    return params


def analytic_profile(
    shape: TransformerShape,
    *,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    sustained_flops: float,
    frozen: Sequence[str] = (),
) -> ModelProfile:
    """A ModelProfile of one micro-batch of ``micro_batch_size x seq_len`` tokens at
    ``sustained_flops`` (FLOP/s the matmuls reach). ``frozen``: shell-style patterns over the
    parameter names ``parameter_list`` gives (``embed_tokens``, ``layers.3.qkv``, ``layers.*``):
    those parameters are frozen (no gradient, no optimizer state; a fine-tuned base)."""
    if seq_len > shape.max_positions and shape.learned_positions:
        raise ValueError(f"seq_len {seq_len} exceeds the model's {shape.max_positions} positions")
    element_size = 4 if precision == "fp32" else 2
    tokens = micro_batch_size * seq_len
    params = parameter_list(shape)
    block_numel = [0] * shape.layers
    for numel, block, _ in params:
        if block >= 0:
            block_numel[block] += numel
    # Forward FLOPs: 2 per weight per token, plus attention scores and their use (2*2*s*h per token).
    attention = 4 * tokens * seq_len * shape.hidden
    blocks = tuple(
        BlockProfile(
            forward_s=(2 * tokens * numel + attention) / sustained_flops,
            backward_s=2 * (2 * tokens * numel + attention) / sustained_flops,
            activation_bytes=int(tokens * shape.hidden * 34 * element_size / 2),
            input_bytes=tokens * shape.hidden * element_size,
        )
        for numel in block_numel
    )
    head = 2 * tokens * shape.hidden * shape.vocab
    logits_fp32 = tokens * shape.vocab * 4
    return ModelProfile(
        batch_shape=(micro_batch_size, seq_len),
        precision=precision,
        element_size=element_size,
        param_sizes=tuple((numel, not any(fnmatchcase(name, p) for p in frozen)) for numel, _, name in params),
        param_block=tuple(block for _, block, _ in params),
        module_params=tuple((index,) for index in range(len(params))),
        blocks=blocks,
        other_forward_s=head / sustained_flops,
        other_backward_s=2 * head / sustained_flops,
        # Embedding output and final norm input, and the logits in compute precision.
        other_activation_bytes=2 * tokens * shape.hidden * element_size + tokens * shape.vocab * element_size,
        transient_bytes=2 * logits_fp32,
    )

"""Model FLOPs per token, torchtitan's definition (``get_num_flop_per_token``, after PaLM's MFU):

    6 * (N - N_embedding) + 12 * L * H * Q * T

N counts the parameters, N_embedding those only looked up (no matmul), L the transformer blocks,
H the attention heads, Q the head size, T the sequence length. A trainable parameter costs 2 FLOPs
per token in forward, 2 for the input gradient and 2 for its own gradient: 6. A frozen one (a
LoRA base) skips its own gradient: 4. The attention term counts the two matmuls of each head
(scores, weighted values) forward and twice in backward, at 2 FLOPs a multiply-add, ignoring the
causal mask's skipped half, as the convention does. Recomputation is not counted (model FLOPs,
not hardware FLOPs): a plan that recomputes blocks shows a lower MFU for the time it spends.

An ``nn.Embedding`` weight is an embedding unless it is tied to a matmul: a GPT-2 style head that
shares the token embedding does ``vocab * width`` multiply-adds per token, so it is counted.
L is the number of blocks the runtime manages (``runtime.blocks``); H and Q come from the model's
config (a Hugging Face config or the repo's GPT config) or, failing that, from attributes of the
first block's modules (``nn.MultiheadAttention`` has them). When they cannot be found the
attention term is left out and ``attention_missing`` says why, once, for the caller to print.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from protrain.runtime.chunks.layout import ParamInfo

HEAD_COUNT_NAMES = ("num_attention_heads", "n_head", "num_heads", "n_heads")
HEAD_DIM_NAMES = ("head_dim", "d_kv")
WIDTH_NAMES = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFlops:
    trainable_params: int
    """Trainable parameters that are not embeddings (6 FLOPs per token each)."""
    frozen_params: int
    """Frozen parameters that are not embeddings (4 FLOPs per token each)."""
    embedding_params: int
    """Left out: looked up, not multiplied."""
    layers: int
    heads: int | None
    head_dim: int | None
    attention_missing: str | None = None
    """Why the attention term is left out (None: it is counted)."""

    @property
    def dense_per_token(self) -> int:
        return 6 * self.trainable_params + 4 * self.frozen_params

    def per_token(self, seq_len: float) -> float:
        """FLOPs per token of a sequence of ``seq_len`` tokens, forward and backward."""
        attention = 0.0
        if self.heads is not None and self.head_dim is not None:
            attention = 12.0 * self.layers * self.heads * self.head_dim * seq_len
        return self.dense_per_token + attention

    def per_update(self, *, tokens: int, samples: int) -> float:
        """FLOPs of ``tokens`` tokens in ``samples`` sequences (T: their mean length)."""
        if tokens <= 0 or samples <= 0:
            return 0.0
        return tokens * self.per_token(tokens / samples)


def model_flops(module: nn.Module, params: Sequence[ParamInfo], blocks: Sequence[nn.Module]) -> ModelFlops:
    """``module``'s FLOPs model from its parameters (``params``: the chunk layout's, by name and
    alias, tied weights once: the model's own tensors may be shrunk while offloaded) and its
    transformer ``blocks``."""
    embedding_owners = {
        name
        for name, sub in module.named_modules(remove_duplicate=False)
        if isinstance(sub, nn.Embedding | nn.EmbeddingBag)
    }
    trainable = frozen = embedding = 0
    for info in params:
        owners = {name.rpartition(".")[0] for name in (info.name, *info.aliases)}
        if owners <= embedding_owners:
            embedding += info.numel
        elif info.trainable:
            trainable += info.numel
        else:
            frozen += info.numel
    shape = attention_shape(module, blocks)
    missing = None
    if shape is None:
        missing = (
            f"the attention heads of {type(module).__name__} were not found (no num_attention_heads "
            "or n_head in its config, nor on its blocks' modules): FLOPs count the parameters only"
        )
    return ModelFlops(
        trainable_params=trainable,
        frozen_params=frozen,
        embedding_params=embedding,
        layers=len(blocks),
        heads=None if shape is None else shape[0],
        head_dim=None if shape is None else shape[1],
        attention_missing=missing,
    )


def attention_shape(module: nn.Module, blocks: Sequence[nn.Module]) -> tuple[int, int] | None:
    """(heads, head size): from the model's config, else from the first block's modules."""
    config = getattr(module, "config", None)
    found = _heads_of(config) if config is not None else None
    if found is None and blocks:
        for sub in blocks[0].modules():
            # An attention module's own attributes, or the config it keeps (a composite model's
            # top-level config holds the heads in a sub-config).
            found = _heads_of(sub) or _heads_of(getattr(sub, "config", None))
            if found is not None:
                break
    return found


def _heads_of(holder: Any) -> tuple[int, int] | None:
    heads = _first_count(holder, HEAD_COUNT_NAMES)
    if heads is None:
        return None
    head_dim = _first_count(holder, HEAD_DIM_NAMES)
    if head_dim is None:
        width = _first_count(holder, WIDTH_NAMES)
        if width is None or width % heads:
            return None
        head_dim = width // heads
    return heads, head_dim


def _first_count(holder: Any, names: Sequence[str]) -> int | None:
    """The first of ``names`` that ``holder`` has as a positive int (a config's head_dim may be
    None, a module's attribute of the same name something else entirely)."""
    for name in names:
        value = getattr(holder, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None

"""A plain GPT-style causal language model (pre-norm, learned positions, tied embeddings).

Used by the demo, the tests and the what-if planner; nothing in it knows about ProTrain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    qkv_bias: bool = True
    """The key bias never changes attention (softmax ignores a per-query constant), so its exact
    gradient is zero and Adam amplifies rounding noise in it; equivalence tests keep it and judge
    it against the same training in float64 (DESIGN section 6)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64),
    "demo": GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128),
    "gpt2-124m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768),
}


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [batch, seq, vocab]
    loss: torch.Tensor | None


class SelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.qkv_bias)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, seq, d_model]
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        shape = (batch, seq, self.n_head, width // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))  # [batch, head, seq, dim]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        self.apply(self._init_weights)

    def tie_weights(self) -> None:
        """The head shares the embedding (when the config says so). Hugging Face's name for it:
        accelerate's ``init_empty_weights`` gives every registered parameter a new object, which
        unties them, and loaders call this afterwards, as ``from_pretrained`` does."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids, labels: [batch, seq]; labels are the next tokens (-100 ignored)."""
        batch, seq = input_ids.shape
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds the model's {self.config.seq_len}")
        positions = torch.arange(seq, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
        return CausalLMOutput(logits=logits, loss=loss)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

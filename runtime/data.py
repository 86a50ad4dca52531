"""A byte-level corpus from text that ships with Python, and a deterministic, rank-sharded
batch source: the batch of (update, micro-batch, rank) is a pure function of the seed and the
job's shape (micro-batch size, accumulation steps, world size), so a single-process reference can
rebuild exactly what every rank saw (the equivalence tests rely on it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def stdlib_text_corpus() -> torch.Tensor:
    """The bytes of Python's own help topics (``pydoc_data``, ~460 KB of English)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)


@dataclass(frozen=True, slots=True, kw_only=True)
class LMBatches:
    """Random windows of ``seq_len + 1`` tokens; global batch = micro x accumulation x ranks."""

    tokens: torch.Tensor  # [num_tokens], int64
    seq_len: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    seed: int

    def global_offsets(self, update: int) -> torch.Tensor:
        """Window starts of every sample in update ``update``, ordered (micro, rank, sample)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + update)
        count = self.micro_batch_size * self.gradient_accumulation_steps * self.world_size
        return torch.randint(0, self.tokens.numel() - self.seq_len - 1, (count,), generator=generator)

    def batch(self, update: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        """``input_ids`` and ``labels`` [micro_batch_size, seq_len] for one rank's micro-batch."""
        offsets = self.global_offsets(update).view(
            self.gradient_accumulation_steps, self.world_size, self.micro_batch_size
        )
        return self._windows(offsets[micro, rank])

    def _windows(self, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        index = offsets[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = self.tokens[index]
        return {"input_ids": window[:, :-1].contiguous(), "labels": window[:, 1:].contiguous()}

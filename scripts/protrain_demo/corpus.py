"""A byte-level corpus from text that ships with Python; a map-style dataset of its windows (read
through ``engine.data_loader``, whose position checkpoints save); and a deterministic, rank-sharded
batch source: the batch of (update, micro-batch, rank) is a pure function of the seed and the
job's shape (micro-batch size, accumulation steps, world size), so a single-process reference can
rebuild exactly what every rank saw (the equivalence tests rely on it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset


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


class TokenWindows(Dataset[dict[str, torch.Tensor]]):
    """Non-overlapping windows of ``seq_len + 1`` tokens: sample ``i`` is
    ``tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)]`` as ``input_ids`` and ``labels``
    (shifted by one); a trailing partial window is left out."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        count = tokens.numel() // (seq_len + 1)
        if count == 0:
            raise ValueError(f"{tokens.numel()} tokens hold no window of {seq_len + 1}")
        self.windows = tokens[: count * (seq_len + 1)].view(count, seq_len + 1)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window[:-1], "labels": window[1:]}

    def first_batch(self, size: int) -> dict[str, torch.Tensor]:
        """The first ``size`` samples stacked: a batch of the job's shape, for planning."""
        window = self.windows[:size]
        return {"input_ids": window[:, :-1], "labels": window[:, 1:]}

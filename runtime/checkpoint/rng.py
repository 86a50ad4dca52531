"""Each rank's random generators, as checkpoint entries.

Saved per rank (``rng.rank<r>.*``): torch's CPU generator, the current CUDA device's generator,
and Python's ``random``. Resumed on the same world size, every rank gets its own streams back,
so dropout masks continue exactly. On another world size there is no rank-to-rank mapping; the
generators are then seeded from (seed, global step, rank), which keeps the run reproducible but
not identical to the uninterrupted one (the reshard tests use dropout 0 for that reason).
NumPy's global generator is not saved: the engine never uses it.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def _prefix(rank: int) -> str:
    return f"rng.rank{rank}."


def capture(rank: int) -> dict[str, Any]:
    prefix = _prefix(rank)
    state: dict[str, Any] = {
        prefix + "torch": torch.get_rng_state(),
        prefix + "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[prefix + "cuda"] = torch.cuda.get_rng_state()
    return state


def load_targets(rank: int, saved_keys: set[str]) -> dict[str, Any]:
    """Placeholders DCP fills with this rank's saved generator states (those that were saved)."""
    prefix = _prefix(rank)
    targets: dict[str, Any] = {}
    if prefix + "torch" in saved_keys:
        targets[prefix + "torch"] = torch.empty_like(torch.get_rng_state())
    if prefix + "python" in saved_keys:
        targets[prefix + "python"] = None
    if prefix + "cuda" in saved_keys and torch.cuda.is_available():
        targets[prefix + "cuda"] = torch.empty_like(torch.cuda.get_rng_state())
    return targets


def restore(rank: int, loaded: dict[str, Any]) -> None:
    prefix = _prefix(rank)
    if prefix + "torch" in loaded:
        torch.set_rng_state(loaded[prefix + "torch"])
    if loaded.get(prefix + "python") is not None:
        random.setstate(loaded[prefix + "python"])
    if prefix + "cuda" in loaded and torch.cuda.is_available():
        torch.cuda.set_rng_state(loaded[prefix + "cuda"])


def reseed(seed: int, step: int, rank: int) -> None:
    """Fresh, reproducible streams for a resume on another world size."""
    derived = (seed * 1_000_003 + step) * 4_099 + rank
    torch.manual_seed(derived)
    random.seed(derived)

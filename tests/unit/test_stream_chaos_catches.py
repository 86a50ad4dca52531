"""What stream chaos is for: a wait removed on purpose is caught in training under random chaos
on every one of five seeds (and under lazy chaos), while the same training with every wait in
place is bit-identical to the run without chaos (and, in fp32, matches plain PyTorch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import runtime
from runtime.activations.transfers import ActivationTransfers
from runtime.chunks.grad_buffers import GradientBufferPool
from runtime.chunks.side_stream import CollectiveQueue
from runtime.models.gpt import GPTConfig
from runtime.stream_chaos import StreamChaosError
from runtime.training.update import NonFiniteLossError
from tests.helpers import assert_matches_reference, assert_state_equal, gpt_reference, lm_batches, tiny_gpt

SEEDS = range(5)


FOUR_BLOCKS = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=2, d_model=64)
STEPS = 3
OFFLOADED = {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2}
PERSISTENT_BF16 = {"chunk_size": "64KiB", "n_persist": 9, "n_buffer": 0}
"""Every chunk on the device (the bf16 GPT's 9): with offloaded chunks backward's gathers queue
behind the reductions, and waiting for a gather waits for them too, hiding the pool's wait."""


def _skip_fetch_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # ChunkResidency.ensure_resident waits for a chunk's gather through the collective queue
    # (and nothing else waits through it): compute then reads the slot whenever it likes.
    monkeypatch.setattr(CollectiveQueue, "make_compute_wait", lambda self, event: None)


def _skip_swap_in_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # ActivationTransfers.bytes_back's wait for the copy back from host memory.
    original = ActivationTransfers.bytes_back

    def without_wait(self: ActivationTransfers, record: Any) -> torch.Tensor:
        self.start_inbound(record)
        record.inbound = None
        return original(self, record)

    monkeypatch.setattr(ActivationTransfers, "bytes_back", without_wait)


def _skip_gradient_buffer_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # GradientBufferPool.take's wait for the oldest reduction before its buffer is reused.
    original = GradientBufferPool.take

    def without_wait(self: GradientBufferPool) -> torch.Tensor:
        stream = self.stream
        self.stream = SimpleNamespace(make_compute_wait=lambda event: None)  # type: ignore[assignment]
        try:
            return original(self)
        finally:
            self.stream = stream

    monkeypatch.setattr(GradientBufferPool, "take", without_wait)


def _land_swap_outs_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward waits for each swap-out when it polls it, so every activation comes back through
    host memory. Without this, lazy chaos (whose held copies land only when forward waits for
    them, at the next offloaded block's end) serves the last block's activations from memory,
    and random chaos many more (see the lazy test)."""
    original = ActivationTransfers.arrived

    def landed(self: ActivationTransfers, record: Any) -> bool:
        if record.outbound is not None:
            record.outbound.wait()
        return original(self, record)

    monkeypatch.setattr(ActivationTransfers, "arrived", landed)


def _as_is(monkeypatch: pytest.MonkeyPatch) -> None:
    pass


@dataclass(frozen=True)
class Bug:
    remove_wait: Callable[[pytest.MonkeyPatch], None]
    precision: str
    memory: dict[str, Any]
    route: Callable[[pytest.MonkeyPatch], None] = _as_is
    """How the run is steered through the code whose wait is removed (both runs, and the
    comparison without the bug)."""


BUGS = {
    "chunk-fetch": Bug(_skip_fetch_wait, "fp32", OFFLOADED),
    "swap-in": Bug(_skip_swap_in_wait, "fp32", {"block_modes": ["swap"] * 4}, route=_land_swap_outs_at_once),
    # bf16: one fp32 rank accumulates into its shards directly, with no gradient buffer.
    "gradient-buffer": Bug(_skip_gradient_buffer_wait, "bf16", PERSISTENT_BF16),
}


def chaos_training(
    tmp_path: Path, precision: str, memory: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], list[float]]:
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "precision": precision,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": memory,
        "output_dir": str(tmp_path),
    }
    engine = runtime.initialize(tiny_gpt(0, FOUR_BLOCKS), config=config)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    losses = []
    with engine:
        for update in range(STEPS):
            out = engine(**data.batch(update, 0, 0))
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
        return engine.state_dict(), losses


def assert_caught(
    tmp_path: Path,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    chaos: Callable[..., None],
    mode: str,
    seed: int,
) -> None:
    """Train without the wait under chaos: it must raise (a reuse under pending work, NaN read
    through the missing wait) or end elsewhere than the same run without chaos."""
    bug = BUGS[name]
    bug.route(monkeypatch)
    chaos("0")
    expected, _ = chaos_training(tmp_path / "plain", bug.precision, bug.memory)
    bug.remove_wait(monkeypatch)
    chaos(mode, seed)
    try:
        state, _ = chaos_training(tmp_path / "chaos", bug.precision, bug.memory)
    except (StreamChaosError, NonFiniteLossError):
        return
    differs = [key for key, value in state.items() if not torch.equal(value, expected[key])]
    assert differs, f"{name} wait removed, chaos {mode} seed {seed}: training went unnoticed"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["chunk-fetch"])
def test_random_chaos_catches_a_missing_wait_on_every_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chaos: Callable[..., None], name: str, seed: int
) -> None:
    """Compute reaches this wait while the gather is still held back: about 113 of 120 chunk
    waits per run found it pending (measured over seeds 0-4). The gradient-buffer wait is left
    to lazy chaos: only 15 of 21 reuses found their reduction pending, and on a loaded machine
    (compute slower, reductions done first) seeds 3 and 4 once found none."""
    assert_caught(tmp_path, name, monkeypatch, chaos, "1", seed)


@pytest.mark.parametrize("name", sorted(BUGS))
def test_lazy_chaos_catches_every_missing_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chaos: Callable[..., None], name: str
) -> None:
    """Lazy chaos is the deterministic worst case: held work never happens early. The swap-in
    wait is left to it: random delays rarely reach it, with swap-ins prefetched blocks ahead
    (1 or 2 of 132 reads per run found their copy pending, none in some seeds)."""
    assert_caught(tmp_path, name, monkeypatch, chaos, "lazy", 0)


def test_lazy_chaos_alone_serves_the_last_swapped_block_from_memory(
    tmp_path: Path, chaos: Callable[..., None]
) -> None:
    """Why the swap-in runs above are routed: forward polls its swap-outs without waiting, which
    never asks for lazily held work; it waits for a block's copies only at the end of the next
    offloaded block (the bound on bytes in flight), so the last block's activations never go
    through host memory."""
    chaos("lazy")
    engine = runtime.initialize(
        tiny_gpt(0, FOUR_BLOCKS),
        config={
            "seed": 3,
            "micro_batch_size": 2,
            "memory": {"block_modes": ["swap"] * 4},
            "output_dir": str(tmp_path),
        },
    )
    with engine:
        out = engine(**lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0))
        engine.backward(out.loss)
        engine.step()
        stats = engine.activations.stats
        blocks = len(engine.plan.block_modes)
        assert stats.records > 0 and stats.forwarded == stats.records // blocks and stats.bytes_swapped_in > 0


@pytest.mark.parametrize("mode", ["1", "lazy"])
@pytest.mark.parametrize("name", sorted(BUGS))
def test_with_every_wait_in_place_chaos_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chaos: Callable[..., None], name: str, mode: str
) -> None:
    bug = BUGS[name]
    bug.route(monkeypatch)
    chaos("0")
    expected, expected_losses = chaos_training(tmp_path / "plain", bug.precision, bug.memory)
    chaos(mode, seed=1)
    state, losses = chaos_training(tmp_path / "chaos", bug.precision, bug.memory)
    assert_state_equal(state, expected)
    assert losses == expected_losses
    if bug.precision == "fp32":
        reference = gpt_reference(FOUR_BLOCKS, steps=STEPS, lr=1e-3, weight_decay=0.1)
        assert_matches_reference(state, reference.fp32, reference.fp64)

"""Which thread does which host work in a bf16 run with offloaded chunks, seen from outside the
runtime: every ``add_`` and ``copy_`` on a tensor is recorded with its thread and dtypes while the
engine trains (the pipeline's jobs call these tensor methods, whatever thread they run on)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from tests.helpers import lm_batches, tiny_gpt

Call = tuple[str, str, torch.dtype, torch.dtype]
"""(thread name, method, the tensor's dtype, the argument's dtype)."""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Call]]:
    recorded: list[Call] = []

    def spy(method: str) -> Any:
        original = getattr(torch.Tensor, method)

        def wrapper(self: torch.Tensor, other: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(other, torch.Tensor):
                recorded.append((threading.current_thread().name, method, self.dtype, other.dtype))
            return original(self, other, *args, **kwargs)

        return wrapper

    for method in ("add_", "copy_"):
        monkeypatch.setattr(torch.Tensor, method, spy(method))
    yield recorded


def test_host_work_widens_before_adding_and_the_side_stream_thread_only_issues(
    tmp_path: Path, calls: list[Call]
) -> None:
    """bf16 compute, two micro-batches per update (gradients kept in fp32 host shards).

    - The host worker widens each staged bf16 gradient into fp32 scratch, then adds fp32 to fp32:
      torch's mixed-dtype ``add_`` has no vectorised CPU path (131 ms against 32 ms on 64M
      elements). Before, it added bf16 into fp32 directly.
    - The side stream's thread (``protrain-chunks``, which issues every gather and reduction)
      converts nothing: the fp32 masters are downcast for upload on the upload thread. Before,
      the downcast ran on the side stream's thread, so a host stall delayed every collective."""
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "precision": "bf16",
        "optimizer": {"lr": 1e-3},
        "memory": {"chunk_size": "32KiB", "n_persist": 1, "n_buffer": 3},
        "output_dir": str(tmp_path / "runs"),
    }
    data = lm_batches(micro_batch_size=2, accumulation=2, world_size=1)
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        assert engine.plan.n_persist < engine.plan.num_chunks
        calls.clear()
        for update in range(2):
            for micro in range(2):
                out = engine(**data.batch(update, micro, 0))
                engine.backward(out.loss)
            engine.step()
    host_adds = [c for c in calls if c[0] == "protrain-host-worker" and c[1] == "add_"]
    assert host_adds, "the host worker added no gradient"
    mixed = sorted({c for c in host_adds if c[2] != c[3]})
    assert not mixed, f"the host worker's mixed-dtype adds: {mixed}"
    assert ("protrain-host-worker", "copy_", torch.float32, torch.bfloat16) in calls  # the widening
    side = [c for c in calls if c[0] == "protrain-chunks"]
    assert side, "the side stream issued nothing"
    conversions = sorted({c for c in side if c[1] == "copy_" and c[2] != c[3]})
    assert not conversions, f"the side stream's thread converted dtypes: {conversions}"
    assert ("protrain-uploads", "copy_", torch.bfloat16, torch.float32) in calls  # the downcast


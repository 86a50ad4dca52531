"""Host memory per offloaded parameter, measured and counted exactly.

Every chunk offloaded, a named GPT size trained through the engine, and host memory sampled at
every hook (each module's forward pre- and post-hook, each parameter's gradient hook, after each
step): the mapped host regions (``host_arena_bytes``) equal the planner's predicted host bytes to
the byte, and stay within 16 bytes per parameter with gradients kept (clipping, accumulation),
12 when each gradient is applied as it arrives, plus at most three fp32 chunks of staging
(within the issue's bound of n_buffer + 2).
Beside the runtime's count, the state tensors themselves are walked: they hold exactly the
model's parameter count (no chunk padding) and lie inside regions the kernel has mapped
(/proc/self/maps), at least as large as counted.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from protrain_demo.gpt import GPTConfig

from protrain import runtime
from protrain.runtime.hw.host_memory import PAGE_BYTES, host_arena_bytes
from tests.helpers import lm_batches, tiny_gpt

GPT_4X128 = GPTConfig(vocab_size=512, seq_len=32, n_layer=4, n_head=4, d_model=128)
"""The named size these figures are for: GPT, 4 layers of width 128, 0.87M parameters."""
CHUNK_BYTES = 256 << 10
N_BUFFER = 2


@dataclass(frozen=True)
class Case:
    spec: dict[str, Any]
    bytes_per_param: int
    accumulation: int = 1
    n_optimizer: int = 0
    """Offloaded chunks whose optimizer state is in files (8 bytes per parameter fewer there; in
    bf16 the fp32 master too, the host keeping a 2-byte compute copy: 10 fewer; a kept gradient
    too: 4 more), and the NVMe tier's slots and gradient buffers beside the staging."""

    @property
    def keeps_gradients(self) -> bool:
        return "gradient_clipping" in self.spec or self.accumulation > 1


CASES = {
    "clipping": Case({"gradient_clipping": 1.0}, 16),
    "accumulation": Case({"gradient_accumulation_steps": 2}, 16, accumulation=2),
    "applied-as-they-arrive": Case({}, 12),
    "applied-as-they-arrive-bf16": Case({"precision": "bf16"}, 12),
    "optimizer-state-on-nvme": Case({"gradient_clipping": 1.0}, 16, n_optimizer=2),
    "master-and-state-on-nvme-bf16": Case({"precision": "bf16"}, 12, n_optimizer=4),
    "gradients-on-nvme-bf16": Case(
        {"precision": "bf16", "gradient_accumulation_steps": 2}, 16, accumulation=2, n_optimizer=4
    ),
}


def mapped_regions() -> list[tuple[int, int]]:
    """(start, end) of every mapping of this process, as the kernel lists them."""
    regions = []
    with open("/proc/self/maps", encoding="ascii") as maps:
        for line in maps:
            start, end = line.split()[0].split("-")
            regions.append((int(start, 16), int(end, 16)))
    return regions


def host_state(engine: Any) -> Iterator[torch.Tensor]:
    """Every offloaded chunk's host tensors: master, moments, gradient shard when kept."""
    for chunk in engine.chunks.chunks:
        if chunk.persistent:
            continue
        yield chunk.master
        if chunk.training is not None and chunk.state_on_nvme:
            assert chunk.training.grad_shard is None, "an NVMe chunk's kept gradient is in a file"
        elif chunk.training is not None:
            yield chunk.training.optimizer.exp_avg
            yield chunk.training.optimizer.exp_avg_sq
            if chunk.training.grad_shard is not None:
                yield chunk.training.grad_shard


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_host_bytes_per_offloaded_parameter_are_counted_exactly(tmp_path: Path, case: Case) -> None:
    gc.collect()  # regions of engines other tests left unreferenced
    before = host_arena_bytes()[0]
    model = tiny_gpt(seed=0, config=GPT_4X128)
    parameters = sum(p.numel() for p in model.parameters())  # tied weights once
    config = {
        "seed": 1,
        "micro_batch_size": 2,
        "output_dir": str(tmp_path / "runs"),
        "memory": {
            "chunk_size": CHUNK_BYTES,
            "n_persist": 0,
            "n_buffer": N_BUFFER,
            "n_swap": 0,
            "n_checkpoint": 0,
        },
        **case.spec,
    }
    if case.n_optimizer:
        # No ssd blocks on the same path: n_swap is what the search fills (it keeps every block).
        ssd = {"path": str(tmp_path / "nvme"), "n_offload": 0, "n_optimizer": case.n_optimizer}
        config["memory"].update(ssd=ssd, n_swap="auto")
    data = lm_batches(micro_batch_size=2, accumulation=case.accumulation, world_size=1, seq_len=32)
    samples: list[int] = []

    def sample(*_: Any) -> None:
        samples.append(host_arena_bytes()[0] - before)

    with runtime.initialize(model, config=config) as engine:
        assert engine.plan.n_persist == 0 and engine.plan.n_buffer == N_BUFFER and engine.plan.n_swap == 0
        handles = [m.register_forward_pre_hook(sample) for m in engine.module.modules()]
        handles += [m.register_forward_hook(sample) for m in engine.module.modules()]
        handles += [p.register_post_accumulate_grad_hook(sample) for p in engine.module.parameters()]
        for update in range(3):
            for micro in range(case.accumulation):
                out = engine(**data.batch(update, micro, 0))
                engine.backward(out.loss)
                engine.step()
                sample()
        for handle in handles:
            handle.remove()

        # The state tensors hold the parameters' real elements and nothing else.
        state = list(host_state(engine))
        state_bytes = sum(t.numel() * t.element_size() for t in state)
        on_nvme = sum(chunk.master.numel() for chunk in engine.chunks.chunks if chunk.state_on_nvme)
        assert (on_nvme > 0) == (case.n_optimizer > 0)
        bf16 = case.spec.get("precision") == "bf16"
        in_files = (10 if bf16 else 8) + (4 if case.keeps_gradients else 0)
        assert state_bytes == case.bytes_per_param * parameters - in_files * on_nvme
        regions = mapped_regions()
        for tensor in state:
            begin = tensor.data_ptr()
            assert any(start <= begin and begin + tensor.nbytes <= end for start, end in regions)
        # The plan's host regions: its host figure less what it holds outside them (the
        # process at start; an async save's staging), checked by tests/unit/test_host_budget.py.
        predicted = engine.plan.predicted_peak_host_bytes - engine.plan.host_fixed_bytes
        assert engine.chunks.host_bytes() == predicted  # the engine's own count, as the timeline shows
        chunk_fp32 = engine.chunks.layout.chunk_numel * 4
        nvme = engine.chunks.store.tiers.nvme
        slots = 0 if nvme is None else nvme.slot_bytes
        # The NVMe tier's slots: one per NVMe chunk up to three, each a chunk's two moments (and
        # in bf16 its fp32 master); kept gradients pass through two buffers of a chunk each.
        gradient_buffers = min(2, case.n_optimizer) if case.keeps_gradients else 0
        assert slots == (min(3, case.n_optimizer) * (3 if bf16 else 2) + gradient_buffers) * chunk_fp32

    peak = max(samples)
    assert min(samples) == peak, "host regions are fixed for the run: mapped once, never grown"
    assert peak == predicted, f"measured {peak:,} host bytes, the cost model counts {predicted:,}"
    staging = peak - state_bytes - slots
    # Three fp32 chunks at most (one rank: a shard is a chunk), plus alignment and a page.
    assert 0 < staging <= min(3 * chunk_fp32 + 2 * PAGE_BYTES, (N_BUFFER + 2) * chunk_fp32), (
        f"{peak / parameters:.2f} bytes per parameter: {case.bytes_per_param} x {parameters:,} parameters "
        f"+ {staging:,} staging, over (n_buffer + 2) chunks of {chunk_fp32:,} bytes"
    )

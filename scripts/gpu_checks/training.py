"""What the correctness sections (equivalence, two_ranks, checkpoint) share: the GPT at the run's
size, its batches on the device for plain PyTorch, engine specs whose plan is exactly what they
say, the training loop, where the parameters a module reads lie, and the device's peak.

Plain PyTorch is the suite's oracle (tests/helpers.py); this module only moves it to the device:
``train_reference`` reads ``data.batch()``, which gives host tensors, so the reference gets a
``DeviceBatches`` (the engine moves its batches itself and gets the plain ``LMBatches``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_checks.common import Context
from protrain_demo.corpus import LMBatches
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.memory_counter import PeakWindow
from protrain_demo.gpt import GPTConfig
from tests.helpers import TINY_GPT, lm_batches

GPU_GPT = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256)
"""3.2M parameters: every step takes milliseconds, so a section runs many plans in minutes."""
REHEARSAL_GPT = dataclasses.replace(TINY_GPT, n_layer=4)
"""The suite's tiny GPT with four blocks: one for each activation mode (swap, checkpoint, ssd,
keep) in one run."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    model: GPTConfig
    micro_batch: int
    steps: int
    """Optimizer updates per training run."""


def sizes(ctx: Context) -> Sizes:
    if ctx.rehearsal:
        return Sizes(model=REHEARSAL_GPT, micro_batch=2, steps=3)
    return Sizes(model=GPU_GPT, micro_batch=8, steps=10)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceBatches(LMBatches):
    """The same batches, on ``device``: what plain PyTorch trains on there."""

    device: torch.device

    def batch(self, update: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in LMBatches.batch(self, update, micro, rank).items()}


def lm_data(size: Sizes, *, accumulation: int = 1, world_size: int = 1) -> LMBatches:
    return lm_batches(
        micro_batch_size=size.micro_batch,
        accumulation=accumulation,
        world_size=world_size,
        seq_len=size.model.seq_len,
    )


def on_device(data: LMBatches, device: torch.device) -> DeviceBatches:
    values = {f.name: getattr(data, f.name) for f in dataclasses.fields(LMBatches)}
    return DeviceBatches(**values, device=device)


def chunk_bytes(model: nn.Module, *, element_size: int, min_chunks: int) -> int:
    """A chunk size (a multiple of 4 KiB) that splits the model into at least ``min_chunks``
    chunks of ``element_size``-byte elements while its largest parameter still fits one."""
    sizes = [p.numel() * element_size for p in model.parameters()]
    target = max(max(sizes), sum(sizes) // (min_chunks + 2))
    return math.ceil(target / 4096) * 4096


def engine_spec(
    out: Path,
    *,
    micro_batch: int,
    memory: Mapping[str, Any],
    precision: str = "fp32",
    profiles: Path | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A job spec with the suite's optimizer (AdamW, lr 1e-3, weight decay 0.1, constant lr) and
    its run folder under ``out``; ``memory`` as given (set every chunk knob and ``block_modes``
    for a plan that is exactly what it says: nothing is then left to a search). ``profiles``:
    the profile cache (default ``out/profiles``), shared by runs that should reuse one."""
    return {
        "seed": 3,
        "micro_batch_size": micro_batch,
        "precision": precision,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": dict(memory),
        "profiler": {"cache_dir": str(profiles or out / "profiles")},
        "output_dir": str(out / "runs"),
        **extra,
    }


def train(engine: Any, data: LMBatches, steps: int, *, rank: int = 0) -> list[float]:
    """``steps`` updates through the engine (every micro-batch of each window); this rank's
    window losses."""
    losses = []
    for update in range(steps):
        window = 0.0
        for micro in range(data.gradient_accumulation_steps):
            out = engine(**data.batch(update, micro, rank))
            engine.backward(out.loss)
            window += out.loss.item()
            engine.step()
        losses.append(window / data.gradient_accumulation_steps)
    return losses


def to_cpu(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


def unequal(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> list[str]:
    """Tensors that differ in any bit (``tests.helpers.assert_state_equal`` without raising)."""
    if set(actual) != set(expected):
        return [f"names differ: {sorted(set(actual) ^ set(expected))}"]
    return [
        f"{name} (max {(actual[name].double() - ref.double()).abs().max():.3e})"
        for name, ref in expected.items()
        if not torch.equal(actual[name], ref)
    ]


def worst_relative(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """The largest max|a - b| / max|b| over the tensors (a figure beside the oracle's verdict)."""
    return max(
        ((actual[n].double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()
        for n, ref in expected.items()
    )


def grad_norms(out: Path) -> list[float]:
    """The pre-clip gradient norm of every update, from the engine's own metrics file (the
    norm ``clip_grad_norm_`` returns: before clipping)."""
    norms = []
    for path in sorted(out.glob("runs/*/metrics.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "step" in record and record.get("grad_norm") is not None:
                norms.append(float(record["grad_norm"]))
    return norms


def _ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


@dataclass(slots=True)
class PoolReads:
    """What ``pool_reads`` found: reads from outside the device pool, and how many reads of a
    recomputed block came from the private copies the engine makes for recomputation."""

    problems: list[str] = field(default_factory=list)
    private_in_recompute: int = 0


@contextmanager
def pool_reads(engine: Any) -> Iterator[PoolReads]:
    """Every parameter a module reads (before and after its forward) must lie in the engine's
    device buffers or persistent chunks: the residency claim, checked from the addresses the
    modules see, not from the engine's bookkeeping. The pool is read at each call (a plan switch
    builds new buffers). A checkpointed block's recomputation inside backward reads private
    copies of its offloaded parameters by design (``Residency.recomputing``: a slot reused
    before that block's backward ends must not change what it saved); those reads are counted,
    not refused."""
    found = PoolReads()
    hooked = engine.chunks

    def check(module: nn.Module, *_: object) -> None:
        pool = _ranges(list(engine.chunks.slots))
        pool += _ranges([c.full for c in engine.chunks.chunks if c.persistent and c.full is not None])
        in_backward = torch._C._current_graph_task_id() != -1
        for name, param in module.named_parameters(recurse=False):
            pointer = param.data_ptr()
            if param.untyped_storage().nbytes() <= param.element_size():
                found.problems.append(f"{type(module).__name__}.{name} evicted while its module runs")
            elif any(start <= pointer < end for start, end in pool):
                continue
            elif in_backward:
                found.private_in_recompute += 1
            else:
                found.problems.append(f"{type(module).__name__}.{name} read outside the device pool")

    def before(module: nn.Module, *_: object) -> None:
        # Registered after the engine's gathering pre-hooks, so it sees what the module will
        # read; a plan switch installs new ones after it: the check after forward remains.
        if engine.chunks is hooked:
            check(module)

    handles = []
    for module in engine.module.modules():
        if any(True for _ in module.parameters(recurse=False)):
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(check))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def device_peak(device: torch.device) -> Iterator[list[int]]:
    """The highest device allocation in the block, as the engine's own counter reads it
    (``runtime.hw.memory_counter``: the engine resets CUDA's peak at its hooks, and a window open
    receives every reading, so none is lost). On CUDA the allocator's absolute peak
    (``max_memory_allocated``, everything allocated counts); on CPU the C heap's growth at the
    readings taken (a figure only: the heap is not a device). The list holds it afterwards."""
    gc.collect()  # what earlier runs left in reference cycles must not count here
    info = DeviceInfo(device, "nccl" if device.type == "cuda" else "gloo")
    window = PeakWindow(info)
    result: list[int] = []
    window.open()
    try:
        yield result
    finally:
        highest = window.close()
        result.append(highest if device.type == "cuda" else max(0, highest - window.base))

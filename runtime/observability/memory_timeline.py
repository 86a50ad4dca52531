"""One update's memory through time: device-tier, host and SSD bytes, sampled at the hooks the
plan check and the profiler sample at (``runtime.hw.memory_counter.sample_at_hooks``: after every
module's forward, after every trainable parameter's gradient), with what happened between.

- Device bytes come from the one device counter (``device_peak_since_last_sample``): on CUDA
  the allocator's peak since the previous sample (a peak inside an operator shows); on CPU, where
  the C heap stands in for the device tier and holds the whole process besides, the engine's
  static device state plus the heap's rise since the update began, as the plan check counts its
  measured peak (runtime/planning/memory_probe.py), so the plan's predicted peak compares.
- Host bytes are the host arenas: the chunks' (fp32 masters, Adam moments, offloaded shards: a
  constant through the step) and the swapped activations' pool, which fills in forward and
  empties in backward. SSD bytes are the activation files on disk.
- Marks: a chunk's gather (its upload started, a prefetch too) and eviction, read from the chunk
  states at each sample (so placed at the next hook after they happened); each block's forward
  start (a forward pre-hook) and backward start (a hook on the gradient of its output).
- Spans: the model's forward (its root module's pre-hook to its hook), backward (from there to
  the last gradient), what lies between micro-batches, and the optimizer (the last gradient of
  the window to the update's end, which is after the engine's final synchronize).
- A module's forward that runs while backward is under way is a checkpointed block's
  recomputation: its samples say ``recompute``.

Cost: the hooks exist only during the recorded update (removed at its end); each sample reads
the device counter, two arena counters and the chunk states.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch import nn

from protrain.profiler.plan import Plan
from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.chunks.residency_states import Residency
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.memory_counter import peak_reader, sample_at_hooks
from protrain.runtime.observability.timeline_file import Mark, Sample, Span, Timeline


class MemoryTimeline:
    """Samples one update (see the module docstring): built at its first forward, ``finish``
    at its end (or ``close`` to drop it)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        chunks: ChunkManager,
        activations: ActivationManager,
        device: DeviceInfo,
        update: int,
        rank: int,
    ) -> None:
        self.update = update
        self.rank = rank
        self._chunks = chunks
        self._activations = activations
        self._device = device
        self._read_device = peak_reader(device)
        # CPU: the C heap holds the whole process; count, as the plan check does
        # (runtime/planning/memory_probe.py), the engine's static device state plus the heap's rise.
        self._device_base = 0 if device.is_cuda else self._read_device() - chunks.device_state_bytes()
        self._chunk_host_bytes = chunks.host_bytes()  # chunk state and staging: what the plan counts
        self._t0 = time.perf_counter()
        self._samples: list[Sample] = []
        self._marks: list[Mark] = []
        self._spans: list[Span] = []
        self._model_phase = "between"
        self._span_start = 0.0
        self._last_gradient: float | None = None
        self._states = [chunk.residency for chunk in chunks.chunks]
        self._handles: list[Any] = sample_at_hooks(
            module, after_forward=self._after_forward, after_gradient=self._after_gradient
        )
        self._handles.append(module.register_forward_pre_hook(self._model_forward_starts))
        self._handles.append(module.register_forward_hook(self._model_forward_ends))
        for index, block in enumerate(activations.blocks):
            self._handles.append(block.register_forward_pre_hook(functools.partial(self._block_starts, index)))
            self._handles.append(block.register_forward_hook(functools.partial(self._block_ends, index)))
        self._sample("start")

    # ------------------------------------------------------------------ hooks

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _sample(self, phase: str) -> None:
        now = self._now()
        store = self._activations.store
        self._samples.append(
            Sample(
                t=now,
                device_bytes=self._read_device() - self._device_base,
                host_bytes=self._chunk_host_bytes + self._activations.host_bytes,
                ssd_bytes=0 if store is None else store.stats.bytes_on_disk,
                phase=phase,
            )
        )
        states = [chunk.residency for chunk in self._chunks.chunks]
        for index, (before, after) in enumerate(zip(self._states, states, strict=True)):
            if before is Residency.HOST and after is not Residency.HOST:
                self._marks.append(Mark(now, "gather", index))
            elif after is Residency.HOST and before is not Residency.HOST:
                self._marks.append(Mark(now, "evict", index))
        self._states = states

    def _after_forward(self) -> None:
        self._sample("recompute" if self._model_phase == "backward" else "forward")

    def _after_gradient(self, _param: torch.Tensor) -> None:
        self._sample("backward")
        self._last_gradient = self._now()

    def _close_span(self, end: float, next_phase: str) -> None:
        if self._model_phase == "backward":
            last = self._last_gradient if self._last_gradient is not None else end
            self._spans.append(Span("backward", self._span_start, last))
            self._span_start = last
            self._model_phase = "between"
        if end > self._span_start:
            self._spans.append(Span(self._model_phase, self._span_start, end))
        self._span_start, self._model_phase = end, next_phase

    def _model_forward_starts(self, _module: nn.Module, _inputs: Any) -> None:
        if self._model_phase != "forward":
            self._close_span(self._now(), "forward")

    def _model_forward_ends(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        if self._model_phase == "forward":
            now = self._now()
            self._spans.append(Span("forward", self._span_start, now))
            self._span_start, self._model_phase, self._last_gradient = now, "backward", None

    def _block_starts(self, index: int, _module: nn.Module, _inputs: Any) -> None:
        if self._model_phase == "forward":
            self._marks.append(Mark(self._now(), "block_forward", index))

    def _block_ends(self, index: int, _module: nn.Module, _inputs: Any, output: Any) -> None:
        if self._model_phase != "forward" or not torch.is_grad_enabled():
            return
        first = _first_grad_tensor(output)
        if first is not None:
            first.register_hook(lambda _grad: self._marks.append(Mark(self._now(), "block_backward", index)))

    # ------------------------------------------------------------------ the end

    def finish(self, *, predicted: Plan, instrumented: tuple[int, ...]) -> Timeline:
        """The update is over (after the engine's synchronize): the timeline, hooks removed.
        ``predicted``: the plan in force (its predictions and budgets are drawn beside)."""
        end = self._now()
        self._close_span(end, "between")
        if self._spans and self._spans[-1].phase == "between":
            last = self._spans.pop()  # after the window's last gradient: the update itself
            self._spans.append(Span("optimizer", last.start, last.end))
        self._sample("end")
        self.close()
        return Timeline(
            update=self.update,
            rank=self.rank,
            device=str(self._device.device),
            device_reading=(
                "CUDA allocator: the peak since the previous sample"
                if self._device.is_cuda
                else "C heap (the CPU device tier): static device state plus the rise since the update began"
            ),
            samples=tuple(self._samples),
            marks=tuple(sorted(self._marks, key=lambda m: m.t)),
            spans=tuple(self._spans),
            duration_s=end,
            micro_batches=sum(1 for span in self._spans if span.phase == "forward"),
            predicted_step_s=predicted.predicted_step_s,
            predicted_peak_device_bytes=predicted.predicted_peak_device_bytes,
            predicted_peak_host_bytes=predicted.predicted_peak_host_bytes,
            device_budget_bytes=predicted.device_budget_bytes,
            host_budget_bytes=predicted.host_budget_bytes,
            instrumented_updates=instrumented,
        )

    def close(self) -> None:
        """Take the hooks off the model (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor in a block's output that takes a gradient (blocks return a tensor or a
    tuple whose first element is the hidden states)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None

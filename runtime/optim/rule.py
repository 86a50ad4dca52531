"""An optimizer rule: everything the chunk engine, the planner and checkpoints need to know of
one optimizer. The names of its per-parameter state tensors (what a shard holds beside its fp32
master, what a checkpoint saves as ``optim.<state>.<parameter>``, what the planner counts in
host bytes) and the kernel that updates one flat shard, on the host for offloaded chunks and on
the device for persistent ones (runtime/optim/shard.py says what a kernel does).

Free of torch: the spec checks ``optimizer.type`` against the registered rules without loading
it; a kernel named by its import path ("module:function") is imported on first use."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerHyper:
    """What a shard's kernel is built with, from the spec's optimizer section and its groups."""

    weight_decay: Sequence[float]
    """Per parameter (by layout index)."""
    group: Sequence[int]
    """Per parameter (by layout index): its parameter group (runtime/param_groups.py)."""
    lrs: Sequence[float]
    """Per parameter group, the peak learning rate."""
    betas: Sequence[tuple[float, float]]
    """Per parameter group (rules with moments read them)."""
    eps: float
    momentum: float = 0.0
    """SGD's momentum (0: none, and no momentum buffer is kept)."""
    dampening: float = 0.0
    nesterov: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerRule:
    name: str
    """What ``optimizer.type`` calls it."""
    state_names: tuple[str, ...]
    """Per-parameter fp32 state tensors, in the order the kernel's ``states`` gives them."""
    kernel: str | Callable[..., Any]
    """``build(master, segments, *, hyper, states) -> ShardOptimizer`` for one shard, or its
    "module:function" path."""
    reference: str
    """The update it equals (a torch optimizer, or the published rule)."""
    momentum_buffer: bool = False
    """Its one state tensor is a momentum buffer, kept only when ``momentum`` > 0 (SGD)."""
    bytes_moved: int = 28
    """fp32 bytes one update reads and writes per element (AdamW: the master, gradient and two
    moments read, three written): what the what-if scales a hardware file's Adam rate by, the
    update being memory bound."""

    def for_momentum(self, momentum: float) -> OptimizerRule:
        """This rule as a job with ``momentum`` runs it: without its state tensor where that is a
        momentum buffer and momentum is 0 (as ``torch.optim.SGD`` keeps none)."""
        if self.momentum_buffer and momentum == 0.0:
            return dataclasses.replace(self, state_names=(), bytes_moved=12)
        return self

    def build(
        self,
        master: Any,
        segments: Sequence[tuple[int, int, float, int]],
        *,
        hyper: OptimizerHyper,
        states: tuple[Any, ...],
    ) -> Any:
        """The kernel over one shard: ``master`` (flat fp32), ``segments`` (start, numel, weight
        decay, group) each, ``states`` zero-filled tensors shaped like the master, one per
        ``state_names`` entry, where the chunk engine placed them (its host arena, the device)."""
        if len(states) != len(self.state_names):
            raise ValueError(f"{self.name} keeps {len(self.state_names)} state tensors, got {len(states)}")
        return self._kernel()(master, segments, hyper=hyper, states=states)

    def _kernel(self) -> Callable[..., Any]:
        if callable(self.kernel):
            return self.kernel
        module, _, attribute = self.kernel.partition(":")
        function: Callable[..., Any] = getattr(importlib.import_module(module), attribute)
        return function

"""Model state in chunks: ZeRO-3 shards, persistent chunks, device buffers, gradient reduction.

``ChunkManager`` is the one object the engine, the activation manager, checkpoints and plan
switches talk to; it owns four parts and coordinates them, cut along the device/host seam:

    store.py       storage: every chunk's flat shards (fp32 master, Adam moments, the gradient
                   where one is kept), persistent full copies, the host arena, where parameters
                   point (store_build.py builds it)
    residency.py   fetch scheduling: device buffer slots, gather, prefetch, evict, the
                   residency states and their transition table, saved views of slots
    reduce.py      device side of backward: gradient hooks, buffers, reduce-scatter and the copy
                   of the reduced gradient to the shard's device
    optimizer.py   host side: gradient adds into shards (on the host worker), CPU Adam early,
                   in two phases or at the step, the update

plus side_stream.py, the one ordered queue every collective goes through (gathers, the
agreement on a non-finite loss, reduce-scatters), so all ranks pair them up. The reducer hands
reduced gradients (averaged over the ranks: rank_average.py) to the optimizer through
``ReducedGradientSink`` (gradient_sink.py) alone; the residency part learns from the reducer
only which chunks backward is done with. Per-parameter and per-chunk metadata lives in side
tables these parts own, never on the ``Parameter`` objects.

A step, as the engine drives it: forward (pre-hooks gather chunks into slots, prefetching the
next ones), ``end_forward``; before the window's last backward ``begin_last_backward`` (the
ranks agree on a non-finite loss, offloaded chunks may be updated as their gradients arrive);
backward (hooks fill gradient buffers, ready chunks are reduced in reverse order, saved views
of slots are re-gathered), ``finish_backward``; at the boundary ``grad_norm``, maybe
``discard_speculation``/``scale_grads_``, ``step`` (the optimizer rule on every shard, then device
copies refreshed) and ``zero_grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from protrain.profiler.plan import UpdateMode
from protrain.runtime.chunks.grad_buffers import GRADIENT_BUFFERS
from protrain.runtime.chunks.layout import ChunkLayout, check_buffers
from protrain.runtime.chunks.optimizer import ChunkOptimizer
from protrain.runtime.chunks.readout import ChunkReadout
from protrain.runtime.chunks.reduce import GradientReducer
from protrain.runtime.chunks.residency import ChunkResidency, SavedAlias
from protrain.runtime.chunks.side_stream import CollectiveQueue
from protrain.runtime.chunks.store import Chunk, Segment, shard_segments
from protrain.runtime.chunks.store_build import build_store
from protrain.runtime.hw import device_wall, stream_chaos
from protrain.runtime.hw.device import DeviceInfo, SideStream, synchronize
from protrain.runtime.hw.distributed import DistContext, all_reduce_sum_
from protrain.runtime.hw.host_memory import MmapArena
from protrain.runtime.optim.rule import OptimizerHyper, OptimizerRule
from protrain.runtime.optim.shard import GroupValues

__all__ = ["Chunk", "ChunkManager", "SavedAlias", "Segment", "shard_segments"]


class ChunkManager:
    """Owns every chunk, the device slots and the hooks that move data; see module docstring."""

    def __init__(
        self,
        *,
        model: nn.Module,
        layout: ChunkLayout,
        n_persist: int,
        n_buffer: int,
        compute_dtype: torch.dtype,
        device: DeviceInfo,
        dist_ctx: DistContext,
        optimizer: OptimizerRule,
        hyper: OptimizerHyper,
        read_param: Callable[[str], torch.Tensor] | None = None,
        update_mode: UpdateMode = UpdateMode.EARLY,
        n_replicate: int = 0,
        n_optimizer: int = 0,
        nvme_root: Path | None = None,
        nvme_beside: tuple[int, str] = (0, ""),
        gradient_buffers: int = GRADIENT_BUFFERS,
    ) -> None:
        """``read_param(name)``, when given, supplies each parameter's value while its chunk is
        built (the model holds only stand-ins: weights streamed from a file, one at a time).
        ``optimizer``: the rule every trainable shard is updated by, built with ``hyper``.
        ``update_mode``: how offloaded chunks are updated (the plan's; ``on_arrival``: they keep
        no gradient shard and every backward must end its window). ``n_replicate``: of the
        persistent chunks, the first ones replicated on every rank (store.py). ``n_optimizer``:
        the last offloaded chunks keep their optimizer state in files under ``nvme_root``, whose
        disk holds ``nvme_beside`` too ((bytes, in words): checked before the files are made).
        ``gradient_buffers``: backward's pool of chunk-sized gradient buffers (grad_buffers.py)."""
        self.model = model
        self.optimizer_rule = optimizer
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.device = device
        self.dist_ctx = dist_ctx
        params = [model.get_parameter(info.name) for info in layout.params]
        check_buffers(model, params, layout, n_persist=n_persist, n_buffer=n_buffer)
        self.store = build_store(
            params=params,
            layout=layout,
            n_persist=n_persist,
            compute_dtype=compute_dtype,
            device=device,
            dist_ctx=dist_ctx,
            optimizer=optimizer,
            hyper=hyper,
            read_param=read_param,
            keeps_gradients=update_mode.keeps_gradients,
            n_replicate=n_replicate,
            n_optimizer=n_optimizer,
            nvme_root=nvme_root,
            nvme_beside=nvme_beside,
        )
        self.collectives = CollectiveQueue(device)
        self._lazy_chaos = stream_chaos.mode() == "lazy"
        self._drains = 0
        self.optimizer = ChunkOptimizer(store=self.store, mode=update_mode, waits=self.collectives.waits)
        self.reducer = GradientReducer(
            store=self.store, queue=self.collectives, sink=self.optimizer, gradient_buffers=gradient_buffers
        )
        self.residency = ChunkResidency(
            store=self.store,
            n_buffer=n_buffer,
            queue=self.collectives,
            backward_done=self.reducer.backward_done,
            pending_update=self.optimizer.pending_update,
        )
        self.residency.install_hooks(model)
        self.reducer.install_hooks()
        self.reset_backward()

    # ------------------------------------------------------------------ what callers read

    @property
    def params(self) -> list[nn.Parameter]:
        return self.store.params

    @property
    def chunk_of_param(self) -> list[int]:
        return self.store.chunk_of_param

    @property
    def chunks(self) -> list[Chunk]:
        return self.store.chunks

    @property
    def host_arena(self) -> MmapArena | None:
        return self.store.host_arena

    @property
    def slots(self) -> list[torch.Tensor]:
        return self.residency.slots

    @property
    def n_buffer(self) -> int:
        return self.residency.n_buffer

    @property
    def stream(self) -> SideStream:
        """The one thread (CUDA: stream) that issues every collective, in program order."""
        return self.collectives.stream

    @property
    def update_mode(self) -> UpdateMode:
        """How offloaded chunks are updated (the plan's; see ChunkOptimizer)."""
        return self.optimizer.mode

    @property
    def applies_on_arrival(self) -> bool:
        """Offloaded chunks keep no gradient shard: each reduced gradient is applied as it
        arrives, so every backward must end its accumulation window."""
        return self.optimizer.applies_on_arrival

    @property
    def num_gathers(self) -> int:
        """Gathers of non-persistent chunks into slots (a chunk reused from its slot is not one)."""
        return self.residency.num_gathers

    @property
    def num_speculations(self) -> int:
        return self.optimizer.num_speculations

    @property
    def stall_s(self) -> float:
        """Seconds compute waited for chunks during the last ``profiling`` window."""
        return self.residency.stall_s

    def trainable_chunks(self) -> Iterator[Chunk]:
        return self.store.trainable_chunks()

    def resident_chunks(self) -> list[int]:
        return self.residency.resident_chunks()

    # ------------------------------------------------------------------ residency

    def ensure_resident(self, chunk_index: int) -> torch.Tensor:
        return self.residency.ensure_resident(chunk_index)

    def prefetch(self, chunk_indices: Sequence[int], *, evictable: Callable[[int], bool]) -> None:
        self.residency.prefetch(chunk_indices, evictable=evictable)

    def evict(self, chunk_index: int) -> None:
        self.residency.evict(chunk_index)

    def recomputing(self) -> contextlib.AbstractContextManager[None]:
        return self.residency.recomputing()

    def end_forward(self) -> None:
        """Forward is over: no module's chunks need to stay put any more (backward may evict)."""
        self.residency.unpin()

    def pack_alias(self, tensor: torch.Tensor) -> SavedAlias | None:
        return self.residency.pack_alias(tensor)

    def unpack_alias(self, packed: SavedAlias) -> torch.Tensor:
        return self.residency.unpack_alias(packed)

    @torch.no_grad()
    def refresh_full_copies(self, *, frozen_too: bool = False) -> None:
        """After an update: re-gather persistent chunks; drop every buffered copy of the others
        (including prefetches that arrived with pre-update data). ``frozen_too``: also the
        persistent chunks of frozen parameters (after a checkpoint load changed them). The side
        stream drains (the gathers come from the main thread); two-phase updates still running
        on the host worker go on: each offloaded chunk's next gather waits for its own."""
        self.collectives.drain()
        self.residency.refresh(frozen_too=frozen_too)

    def drain(self) -> None:
        """Wait for everything queued on the side stream, then on the host worker: the one
        place, with the waits for data compute needs (residency, grad_buffers), where the main
        thread waits for the pipeline. Collectives from the main thread may only follow a
        drain: every rank must issue its collectives in one order."""
        if self._host_first():
            self.optimizer.drain()
        with self.collectives.waits.timing("reduce"):
            self.collectives.drain()
        self.optimizer.drain()  # counted as a host wait there
        self.reducer.forget_staging()

    def _host_first(self) -> bool:
        """Lazy stream chaos: every other drain asks the host worker before the side stream, so
        that a host job missing its wait for side-stream work (or the reverse) meets that work
        still held in one of every two drains (runtime/hw/stream_chaos.py). Never otherwise."""
        if not self._lazy_chaos:
            return False
        self._drains += 1
        return self._drains % 2 == 0

    def take_waits(self) -> dict[str, float]:
        """Seconds the main thread waited for the pipeline since the last call, by kind
        (waits.py): transfer, reduce, host."""
        return self.collectives.waits.take()

    # ------------------------------------------------------------------ backward

    def reset_backward(self) -> None:
        self.residency.unpin()
        self.reducer.reset()

    def finish_backward(self) -> None:
        """Flush chunks that unused parameters left incomplete, in the fixed order, and wait for
        every reduction to land in the shards."""
        try:
            self.reducer.flush()
            # The side stream only: the host worker's adds of this backward may go on into the
            # next micro-batch (they run in order); the step waits for them (``drain``).
            if self._host_first():
                self.optimizer.drain()
            with self.collectives.waits.timing("reduce"):
                self.collectives.drain()
        finally:
            # Also after a failure: the next backward must not find this one's buffers or count.
            self.reducer.release_buffers()
            self.optimizer.disarm()
            self.reset_backward()

    def begin_last_backward(self, *, lr: GroupValues, local_nonfinite: Callable[[], bool]) -> None:
        """The coming backward ends the accumulation window: update offloaded chunks as their
        gradients arrive, overlapping the rest of backward (the engine calls this). The ranks
        first agree whether any saw a non-finite loss: one tiny all-reduce, queued ahead of the
        reductions (see ChunkOptimizer.arm). Two-phase: no early update, only each offloaded
        shard's squared norm as its gradient completes. ``local_nonfinite()``: whether a loss of
        the window was not finite here (read only for early updates: it waits for the device)."""
        self.reducer.closing_backward()
        mode = self.optimizer.mode
        if mode is UpdateMode.TWO_PHASE or (mode is UpdateMode.DEFERRED and self.gradients_in_files):
            self.optimizer.arm_norms()  # deferred: NVMe chunks' norms while their gradients are here
            return
        if not self.optimizer.may_speculate():
            return
        flag = torch.tensor([1.0 if local_nonfinite() else 0.0], dtype=torch.float64)

        def agree() -> None:
            all_reduce_sum_(flag, self.dist_ctx)

        agreed = self.collectives.submit(agree)
        self.optimizer.arm(lr=lr, agreed=agreed, any_nonfinite=flag)

    def params_with_grad(self) -> torch.Tensor:
        """Per parameter, whether any micro-batch of this window produced a gradient here."""
        return self.reducer.params_with_grad()

    # ------------------------------------------------------------------ the update

    def finish_speculation(self) -> None:
        """Wait for the CPU-Adam thread; no more speculation in this window."""
        self.optimizer.finish_speculation()

    def speculation_undoable(self) -> bool:
        """Whether the window can still be dropped (no early update was made in it)."""
        return self.optimizer.speculation_undoable()

    def discard_speculation(self) -> None:
        """The window's update is dropped: wait for the host worker (an early update made
        cannot be undone, and raises)."""
        self.optimizer.discard_speculation()

    @property
    def gradients_in_files(self) -> bool:
        """NVMe chunks keep their gradients in files (an update takes its factors, unscale and
        clip, rather than passes over the gradients: nvme_grads.py)."""
        return self.optimizer.gradients.files is not None

    def grad_norm(self) -> float:
        self.drain()
        self.reducer.settle()
        return self.optimizer.grad_norm(self.dist_ctx)

    def scale_grads_(self, factor: float) -> None:
        self.drain()  # the host worker may still be adding reduced gradients into the shards
        self.reducer.settle()
        self.optimizer.scale_grads_(factor)

    def step(self, *, lr: GroupValues, active: torch.Tensor, grad_factors: tuple[float, ...] = ()) -> None:
        """The optimizer rule on every trainable shard at ``lr`` (one per parameter group, or one for all;
        ``active``: per parameter, whether any rank produced a gradient this window; gradients
        multiplied by ``grad_factors`` first), then refresh the device copies."""
        self.reducer.settle()
        self.optimizer.step(lr=lr, active=active, grad_factors=grad_factors, then=self.residency.refresh_early)
        self.refresh_full_copies()

    def zero_grad(self) -> None:
        self.collectives.drain()
        self.optimizer.zero_grads()
        self.reducer.new_window()

    # ------------------------------------------------------------------ reading the state

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter in full precision by its own names (tied ones under each name), in
        host memory, read out one chunk at a time (``readout``); every rank calls it."""
        self.drain()
        readout = ChunkReadout(self.store)
        result: dict[str, torch.Tensor] = {}
        try:
            for info, values in readout.chunks():
                assert values is not None
                for index in info.params:
                    param, offset = self.layout.params[index], self.layout.slots[index].offset
                    with device_wall.host_allocations():
                        value = values[offset : offset + param.numel].view(param.shape).clone()
                    for name in (param.name, *param.aliases):
                        result[name] = value
        finally:
            readout.close()
        return result

    def model_state_storages(self) -> set[int]:
        """Storage addresses of chunk memory (slots, persistent copies, shards): a saved tensor
        in one of them is model state, never an activation to swap or write to disk."""
        return self.residency.slot_storages() | self.store.state_storages()

    def host_bytes(self) -> int:
        """Bytes of every host region the chunk engine maps (the chunk state's arena, the staging
        rings, the widening scratch, the NVMe tier's slots): what the planner's host figure
        counts (profiler/host_bytes.py), less any swapped activations'."""
        arena, nvme = self.store.host_arena, self.store.tiers.nvme
        rings = [self.reducer.staging, self.residency.uploads]
        total = (0 if arena is None else arena.capacity_bytes) + (0 if nvme is None else nvme.slot_bytes)
        return total + sum(ring.nbytes for ring in rings if ring is not None) + self.optimizer.widening_bytes

    def device_state_bytes(self) -> int:
        """Bytes of chunk state on the compute device (persistent copies and their fp32 state,
        the buffers), each storage once: the static part of the device peak."""
        return self.store.device_state_bytes(self.residency.slots)

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """Profiling steps run through the chunk engine as training does (chunks gathered in
        forward, saved views of buffer slots re-gathered in backward), so a model whose state
        does not fit the device is profiled too; but their gradients are dropped: nothing is
        reduced or updated. Every gather happens on demand (no prefetch) and synchronously, and
        its seconds are counted in ``stall_s`` for the profiler to take off its clock: a
        prefetch in flight would otherwise be waited for inside a block's time (on CUDA any
        synchronisation waits for the side stream too) and count as compute. Backward reuses
        slots as usual but, with no gradient reported, never evicts ahead. Afterwards the
        gradients are zero and a clean window begins."""
        self.drain()
        self.reducer.begin_profiling()
        self.residency.begin_profiling()
        try:
            yield
        finally:
            self.residency.end_profiling()
            try:
                self.drain()
            finally:
                self.reducer.end_profiling()
                self.zero_grad()
                self.reset_backward()

    def release_device(self) -> None:
        """After ``close``: drop every device tensor this manager holds (persistent copies and
        shards, buffer slots); the parameters view the placeholder. A plan switch does this
        before it builds the next layout, so the device never holds both."""
        self.residency.slots.clear()
        self.store.release_device()

    def close(self) -> None:
        """Stop the workers (each runs what is queued first: the side stream before the host
        worker, whose jobs may wait on the side stream's, and whose own it may wait on), let the
        device finish their copies, then free the hooks and the staging rings, and unlock the host
        state (it stays readable: a plan switch copies from it)."""
        self.collectives.close()
        self.optimizer.close()
        if self.store.tiers.nvme is not None:
            self.store.tiers.nvme.stop()  # its files stay for a plan switch (release_device)
        synchronize(self.device)  # no copy may still read or write a staging buffer
        if self.store.host_arena is not None:
            self.store.host_arena.unpin()
        self.residency.close()
        self.reducer.close()

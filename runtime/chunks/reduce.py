"""Gradient reduction: the device side of backward (hooks, buffers, reduce-scatter, copy to host).

Gradients: a hook after each parameter's gradient accumulation copies the gradient into the
chunk's gradient buffer, taken from a small pool that hands a buffer back once its reduction
has run (grad_buffers.py); when every trainable parameter of a chunk has reported, the chunk is
ready. In fp32, where a rank holds the whole chunk (one rank, or a replicated chunk) autograd
accumulates straight into the fp32 shard instead (``direct_grads``, store.py); a replicated one
is all-reduced in place once per window, in the window's last backward (DDP's
``gradient_as_bucket_view`` with ``no_sync``), which also sums each rank's micro-batches before
the ranks, as DDP does. A further backward in that window finds those chunks' gradients
unpointed and goes through the buffers.
Ready chunks are reduce-scattered strictly in reverse chunk order, the same on every rank
(chunks left incomplete by unused parameters are flushed, in that order, when backward ends),
on the collective queue (side_stream.py) while backward goes on. Every reduction averages over
the ranks; where that is exact, gradients take the 1/world factor as they enter the buffer or
shard instead of in a pass after (rank_average.py).

The device/host seam (what the side stream runs, and the host side's interface): gradient_sink.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from protrain.profiler.host_bytes import gradient_staging_buffers
from protrain.runtime.chunks.grad_buffers import GradientBufferPool
from protrain.runtime.chunks.gradient_sink import ReducedGradientSink
from protrain.runtime.chunks.rank_average import RankAverage
from protrain.runtime.chunks.side_stream import CollectiveQueue
from protrain.runtime.chunks.staging import Staged, StagingRing
from protrain.runtime.chunks.store import Chunk, ChunkStore
from protrain.runtime.chunks.trace_labels import job_label
from protrain.runtime.hw.device import DeviceEvent, used_on_this_stream


def late_gradient(name: str) -> RuntimeError:
    """A gradient that arrived after its chunk's reduction began: it would be lost (a buffered
    chunk's buffer is gone) or race the collective (a shard all-reduced in place)."""
    return RuntimeError(
        f"{name} got a second gradient in one backward after its chunk's reduction began: a "
        "parameter shared by several reentrant checkpoint segments (torch.utils.checkpoint with "
        "use_reentrant=True, as DDP refuses it too); use use_reentrant=False"
    )


class GradientReducer:
    """Gradient hooks, buffers and the ordered reduce-scatters (see the module docstring)."""

    def __init__(
        self, *, store: ChunkStore, queue: CollectiveQueue, sink: ReducedGradientSink, gradient_buffers: int
    ) -> None:
        self.store = store
        self.chunks = store.chunks
        self.queue = queue
        self.sink = sink
        self.average = RankAverage(store.dist_ctx.world_size, store.compute_dtype, store.dist_ctx.group)
        self.grad_pool = GradientBufferPool(
            numel=store.layout.chunk_numel,
            dtype=store.compute_dtype,
            device=store.device,
            stream=queue.stream,
            capacity=gradient_buffers,
        )
        offloaded = [c for c in self.chunks if not c.persistent and c.info.trainable]
        kept = all(c.keeps_gradient for c in offloaded)
        self.staging = (
            StagingRing(
                numel=store.layout.shard_numel,
                dtype=store.compute_dtype,
                pin=store.device.is_cuda,
                count=gradient_staging_buffers(store.compute_dtype.itemsize, keeps_gradients=kept),
            )
            if offloaded
            else None
        )
        """Host buffers the reduced parts of offloaded chunks' gradients are copied into."""
        self._grad_buffers: dict[int, torch.Tensor] = {}
        """The gradient buffer each chunk is filling (taken from ``grad_pool``)."""
        num_params = len(store.params)
        self._remaining = [0] * len(self.chunks)
        self._fired = torch.zeros(num_params, dtype=torch.bool)
        self._fired_in_window = torch.zeros(num_params, dtype=torch.bool)
        self._reached_in_window: set[int] = set()
        """Chunks some gradient reached in this accumulation window."""
        self._entered: set[int] = set()
        """Direct-gradient chunks whose gradients take the 1/world factor as they enter the shard
        in this (closing) backward (``closing_backward``)."""
        self._reduce_order = [c.index for c in reversed(self.chunks) if c.info.trainable]
        self._order_position = {chunk_index: n for n, chunk_index in enumerate(self._reduce_order)}
        self._slots_in_order = {
            c.index: sorted((store.layout.slots[i].offset, store.params[i].numel(), i) for i in c.info.params)
            for c in self.chunks
        }
        """Per chunk, its parameters' (offset, numel, index) in buffer order (``_zero_unwritten``)."""
        self._next_reduction = 0
        self._profiling = False
        self._handles: list[Any] = []
        self._closing = False
        """This backward ends its accumulation window (``closing_backward``)."""
        self._reduced_direct: set[int] = set()
        """Direct-gradient chunks of several ranks all-reduced in this window."""
        self._settled: set[int] = set()
        """Direct-gradient chunks whose parameters without a gradient this window have zeros in
        the shard (``settle``): their gradient for the window is complete."""

    def install_hooks(self) -> None:
        for index, param in enumerate(self.store.params):
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._make_grad_hook(index)))

    def _make_grad_hook(self, index: int) -> Any:
        def on_grad(param: nn.Parameter) -> None:
            self._accept_grad(index, param)

        return on_grad

    # ------------------------------------------------------------------ one backward

    def closing_backward(self) -> None:
        """The coming backward ends its accumulation window: replicated direct-gradient chunks
        are all-reduced as they complete. Those no gradient reached before in the window take
        the ranks' 1/world factor as gradients enter (rank_average.py): no pass after."""
        self._closing = True
        if not self.average.on_entry:
            return
        self._entered = {c.index for c in self.chunks if self._direct(c) and c.index not in self._reached_in_window}
        for chunk_index in self._entered:
            for index in self.chunks[chunk_index].info.params:
                self.store.params[index].grad = None  # may view the shard (after a load, say)

    def reset(self) -> None:
        """A new backward: no parameter has reported, no reduction is issued. Chunks all-reduced
        in place this window take no more gradients there: any further backward in the window
        goes through the buffers (their parameters' ``.grad`` is unpointed until ``new_window``)."""
        self._closing = False
        self._entered.clear()
        for chunk_index in self._reduced_direct:
            for index in self.chunks[chunk_index].info.params:
                self.store.params[index].grad = None
        self._fired.zero_()
        self._next_reduction = 0
        for chunk in self.chunks:
            self._remaining[chunk.index] = sum(1 for i in chunk.info.params if self.store.params[i].requires_grad)

    def new_window(self) -> None:
        """A new accumulation window: no parameter has had a gradient in it. Direct-gradient
        shards are not zeroed: each parameter's ``.grad`` is dropped, so autograd hands its first
        gradient of the window over whole, and ``_accept_grad`` copies it into the shard."""
        self._fired_in_window.zero_()
        self._reached_in_window.clear()
        self._reduced_direct.clear()
        self._settled.clear()
        for chunk in self.chunks:
            if self.store.direct_grads(chunk):
                for index in chunk.info.params:
                    self.store.params[index].grad = None

    def _direct(self, chunk: Chunk) -> bool:
        """Gradients accumulate in the chunk's shard now (not after its all-reduce this window)."""
        return self.store.direct_grads(chunk) and chunk.index not in self._reduced_direct

    def buffers_filling(self) -> int:
        """Gradient buffers of chunks whose reduction is not issued yet (taking gradients, or
        complete and waiting for an earlier chunk in the reduction order)."""
        return len(self._grad_buffers)

    def params_with_grad(self) -> torch.Tensor:
        """Per parameter, whether any micro-batch of this window produced a gradient here."""
        return self._fired_in_window.to(torch.float64)

    def backward_done(self, chunk_index: int) -> bool:
        """Every gradient of the chunk is in: backward will not read its parameters again."""
        return self.chunks[chunk_index].info.trainable and self._remaining[chunk_index] == 0

    @torch.no_grad()
    def _accept_grad(self, index: int, param: nn.Parameter) -> None:
        assert param.grad is not None
        chunk_index = self.store.chunk_of_param[index]
        chunk = self.chunks[chunk_index]
        direct = self._direct(chunk)
        if self._profiling:
            # A profiling step's gradient is dropped (a direct one is zeroed afterwards).
            if not direct:
                param.grad = None
            return
        if not self.sink.accepting():
            self._refuse(index, param, direct)
        if not direct and self._order_position[chunk_index] < self._next_reduction and self._fired[index]:
            raise late_gradient(self.store.layout.params[index].name)
        if direct:
            if self._grad_is_shard_view(index, param):
                pass  # autograd accumulated in place into the shard slice that is its .grad
            elif chunk_index in self._entered:
                # Scaled as it enters; .grad stays None until the chunk's all-reduce is queued,
                # so that another gradient of this backward comes here too, not added in place.
                view = self.store.view(chunk.grad_shard, index)
                if self._fired[index]:
                    self.average.add_(view, param.grad)
                else:
                    self.average.enter_(view, param.grad)
                param.grad = None
            elif not self._fired_in_window[index]:
                # The window's first gradient (.grad was None): copied over the slice's stale
                # values instead of added into a zeroed shard; later ones accumulate in place.
                view = self.store.view(chunk.grad_shard, index)
                view.copy_(param.grad)
                param.grad = view
            else:  # the view was replaced (e.g. set to None by hand)
                raise RuntimeError(
                    f"{self.store.layout.params[index].name}.grad no longer views its gradient shard; "
                    "do not set or replace .grad of a model the engine trains (use engine.step)"
                )
        else:
            buffer = self._grad_buffers.get(chunk_index)
            if buffer is None:
                buffer = self._grad_buffers[chunk_index] = self._take_buffer()
            offset = self.store.layout.slots[index].offset
            region = buffer[offset : offset + param.numel()]
            if self._fired[index]:  # another gradient of it in this backward: summed
                self.average.add_(region, param.grad.reshape(-1))
            else:  # the buffer is not zeroed: what no gradient writes is, before the reduction
                self.average.enter_(region, param.grad.reshape(-1))
            param.grad = None
        if not self._fired[index]:
            self._fired[index] = True
            self._fired_in_window[index] = True
            self._reached_in_window.add(chunk_index)
            self._remaining[chunk_index] -= 1
            if self._remaining[chunk_index] == 0:
                self._issue_ready_reductions()

    def _refuse(self, index: int, param: nn.Parameter, direct: bool) -> None:
        """A gradient outside engine.backward where nothing can keep it: refused at the first
        one, before any buffer, count or reduction is touched (a direct gradient, already in
        its zeroed shard, is taken out again), so the engine goes on as if it had not come."""
        assert param.grad is not None
        if direct and self._grad_is_shard_view(index, param):
            param.grad.zero_()
        else:
            param.grad = None
        raise RuntimeError(
            f"{self.store.layout.params[index].name} got a gradient outside engine.backward: with "
            "gradient_accumulation_steps 1, no clipping and not fp16, offloaded chunks keep no gradient "
            "shard and apply each gradient as it arrives; call engine.backward(loss)"
        )

    def _take_buffer(self) -> torch.Tensor:
        """A gradient buffer, not zeroed (``_zero_unwritten``); a wait here for a reduction still
        running is an exposed one."""
        with self.queue.waits.timing("reduce"):
            return self.grad_pool.take(zeroed=False)

    def _grad_is_shard_view(self, index: int, param: nn.Parameter) -> bool:
        grad_shard = self.chunks[self.store.chunk_of_param[index]].grad_shard
        assert param.grad is not None
        offset = self.store.layout.slots[index].offset * grad_shard.element_size()
        return (
            param.grad.untyped_storage().data_ptr() == grad_shard.untyped_storage().data_ptr()
            and param.grad.storage_offset() * param.grad.element_size()
            == grad_shard.storage_offset() * grad_shard.element_size() + offset
        )

    # ------------------------------------------------------------------ reductions

    def _issue_ready_reductions(self) -> None:
        while self._next_reduction < len(self._reduce_order):
            chunk_index = self._reduce_order[self._next_reduction]
            if self._remaining[chunk_index] > 0:
                return
            self._reduce(chunk_index)
            self._next_reduction += 1

    def flush(self) -> None:
        """Queue the reductions of chunks that unused parameters left incomplete, in the fixed
        order (the caller then drains the queue)."""
        while self._next_reduction < len(self._reduce_order):
            self._reduce(self._reduce_order[self._next_reduction])
            self._next_reduction += 1

    def release_buffers(self) -> None:
        """Backward is over (or failed) and the queue has drained: drop the gradient buffers."""
        self._grad_buffers.clear()
        self.grad_pool.release()

    def forget_staging(self) -> None:
        """The side stream and the host worker drained: no staging buffer is in use."""
        if self.staging is not None:
            self.staging.forget()

    def _reduce(self, chunk_index: int) -> None:
        """Queue the chunk's reduce-scatter on the side stream, and its add into the shard (on
        the device for a persistent chunk, on the host worker for an offloaded one); backward
        goes on meanwhile."""
        chunk = self.chunks[chunk_index]
        buffer = self._grad_buffers.pop(chunk_index, None)
        if self._direct(chunk) and self._closing:
            self._settle(chunk)
        if self._direct(chunk) and self.store.dist_ctx.world_size > 1:
            # In the shard already; summed over the ranks once, in the window's last backward.
            reduced = self._queue_all_reduce(chunk) if self._closing else DeviceEvent.completed()
        elif self._direct(chunk):
            reduced = DeviceEvent.completed()  # the gradients are in the shard already
        elif buffer is None and self.store.dist_ctx.world_size == 1:
            reduced = DeviceEvent.completed()  # no gradient, nothing to add
        else:
            if buffer is None:  # no gradient here; other ranks may have some, so take part anyway
                buffer = self._take_buffer()
            self._zero_unwritten(chunk, buffer)
            reduced = self._queue_reduction(chunk, buffer)
        self.sink.reduction_queued(chunk, reduced, self._fired_in_window)

    @torch.no_grad()
    def _zero_unwritten(self, chunk: Chunk, buffer: torch.Tensor) -> None:
        """Zeros wherever no gradient of this backward was copied into the chunk's buffer (gaps,
        the padding, frozen parameters and those without a gradient): buffers are not zeroed
        when taken, since a full pass to zero what the gradients then overwrite cost backward
        about a tenth of DDP's step on CPU (scripts/bench_peers.py)."""
        start = 0
        for offset, numel, index in self._slots_in_order[chunk.index]:
            if self.store.params[index].requires_grad and self._fired[index]:
                if offset > start:
                    buffer[start:offset].zero_()
                start = max(start, offset + numel)
        if start < buffer.numel():
            buffer[start:].zero_()

    def settle(self) -> None:
        """Before the gradients are read (norm, scaling, update): every direct-gradient chunk
        settled, also those no closing backward reached (a window with no backward)."""
        for chunk in self.chunks:
            if self.store.direct_grads(chunk) and chunk.index not in self._settled:
                self._settle(chunk)

    @torch.no_grad()
    def _settle(self, chunk: Chunk) -> None:
        """Zeros where a parameter of the chunk had no gradient this window: its slice still
        holds an earlier window's (shards are not zeroed between windows)."""
        for index in chunk.info.params:
            if self.store.params[index].requires_grad and not self._fired_in_window[index]:
                self.store.view(chunk.grad_shard, index).zero_()
        self._settled.add(chunk.index)

    def _queue_all_reduce(self, chunk: Chunk) -> DeviceEvent:
        """A replicated direct-gradient chunk: its shard, every micro-batch of the window summed
        in it, averaged over the ranks in place (as ``_reduce_whole`` averages a buffer). The
        parameters of a chunk whose gradients were scaled on entry view their slices again."""
        grad_shard = chunk.grad_shard
        entered = chunk.index in self._entered
        self._reduced_direct.add(chunk.index)

        def all_reduce() -> None:
            with job_label("reduce", chunk.index):
                self.average.whole_(grad_shard, entered=entered)

        reduced = self.queue.submit(all_reduce)
        if entered:
            for index in chunk.info.params:
                if self.store.params[index].requires_grad and self._fired_in_window[index]:
                    self.store.params[index].grad = self.store.view(grad_shard, index)
        return reduced

    def _queue_reduction(self, chunk: Chunk, buffer: torch.Tensor) -> DeviceEvent:
        """The reduction's jobs; the event that fires once the gradient is in the shard."""
        if chunk.persistent:
            grad_shard = chunk.grad_shard
            reduce = self._reduce_whole if chunk.is_replicated else self._reduce_part

            def add_on_device() -> None:
                with job_label("reduce", chunk.index):
                    # The shard holds this rank's real elements: a prefix of its part (of the
                    # whole chunk, replicated).
                    grad_shard.add_(reduce(buffer)[: grad_shard.numel()])

            reduced = self.queue.submit(add_on_device)
            self.grad_pool.reducing(buffer, reduced)
            return reduced
        ring = self.staging
        assert ring is not None, "an offloaded trainable chunk has a staging ring"
        staged = ring.assign()

        def copy_to_host() -> None:
            with job_label("reduce", chunk.index):
                self._copy_to_host(buffer, staged, chunk.numel)

        copied = self.queue.submit(copy_to_host)
        self.grad_pool.reducing(buffer, copied)
        in_shard = self.sink.add_staged(
            chunk, staged.buffer[: chunk.numel], copied, lambda: ring.released(staged), self._fired_in_window
        )
        ring.released_by(staged, in_shard)
        return in_shard

    @torch.no_grad()
    def _copy_to_host(self, buffer: torch.Tensor, staged: Staged, numel: int) -> None:
        """On the side stream: this rank's reduced part (its ``numel`` real elements: the host
        shard holds no padding) into the staging buffer, asynchronously on CUDA (pinned
        memory), once the buffer's previous user has added it. CPU ranks reduce straight into
        the staging buffer (two gloo ranks: the other's part is received there, no copy after)."""
        if self.average.world > 1 and not buffer.is_cuda:
            staged.wait_until_free()
            self.average.part_into(staged.buffer, buffer, numel)
            return
        reduced = self._reduce_part(buffer)
        staged.wait_until_free()
        staged.buffer[:numel].copy_(reduced[:numel], non_blocking=True)

    @torch.no_grad()
    def _reduce_whole(self, buffer: torch.Tensor) -> torch.Tensor:
        """On the side stream: the whole buffer averaged over the ranks (rank_average.py)
        (a replicated chunk: one all-reduce, as DDP's)."""
        used_on_this_stream(buffer)  # allocated on the compute stream (grad_buffers.py)
        return self.average.whole_(buffer)

    @torch.no_grad()
    def _reduce_part(self, buffer: torch.Tensor) -> torch.Tensor:
        """On the side stream: this rank's part of the buffer averaged over the ranks, in the
        compute dtype on the device."""
        used_on_this_stream(buffer)  # allocated on the compute stream (grad_buffers.py)
        return self.average.part_(buffer)

    # ------------------------------------------------------------------ profiling

    def begin_profiling(self) -> None:
        """Gradients are dropped until ``end_profiling``: nothing is reduced."""
        self._profiling = True

    def end_profiling(self) -> None:
        """After the queue drained: drop the buffers and every gradient the profiling steps
        left, point direct gradients at their shards again (the caller zeroes the shards)."""
        self._profiling = False
        self.release_buffers()
        for chunk in self.chunks:
            if not self._direct(chunk):
                for index in chunk.info.params:
                    self.store.params[index].grad = None
            self.store.point_grads(chunk)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.staging is not None:
            self.staging.close()

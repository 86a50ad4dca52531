"""The host side of a step: gradient adds into shards, CPU Adam early or in two phases, the update.

Optimizer: persistent chunks are updated at the accumulation boundary. How offloaded chunks are
updated depends on whether the window's update needs the global gradient norm first (clipping,
fp16's overflow check), which is known only after the last gradient:

- no (unclipped fp32/bf16): speculative. Each offloaded chunk is updated on the host worker
  during the window's last backward, as soon as its gradient is in, overlapping the rest of
  backward. Without accumulation an offloaded chunk keeps no gradient shard at all (12 host
  bytes per parameter, not 16): its reduced gradient is applied straight from the staging buffer
  it landed in (widened to fp32 in one scratch shard first when the compute dtype is not fp32),
  and the buffer is reused. With several ranks, a segment that had no gradient here may have had
  one on another rank, which only the step's agreement tells: its reduced gradient is held until
  then (the one gradient kept; none where every rank uses every parameter). The ranks agree
  before that backward whether any saw a non-finite loss (then the step is skipped and nothing
  is updated early). Nothing can undo an early update (no snapshot is kept), so a backward that
  fails after one leaves the engine torn until a checkpoint is loaded.
- yes, where host work runs beside compute (CUDA): two-phase. The last backward only takes each
  offloaded shard's squared norm on the host worker; the step computes the norm from them and
  queues each offloaded chunk's update (unscale and clip factors applied there, then the
  gradient zeroed) on the host worker in forward order, overlapping the next forward, whose
  gather of a chunk waits for that chunk's update. Bit-exact AdamW, no undo state.
- yes, on CPU: deferred to the step (the host worker would take the cores compute uses).

No mode updates early and undoes from a snapshot when the clip triggers: that was slower than
both and held more host memory (docs/decisions/0001-offloaded-update-modes.md).

An NVMe chunk (``memory.ssd.n_optimizer``) is updated the same way, its optimizer state brought
into a host slot around each update and the next one's read ahead (nvme_state.py), its kept
gradient in a file passing through a host buffer (nvme_grads.py, ``KeptGradients``).

This side receives reduced gradients through ``ReducedGradientSink`` (gradient_sink.py) and nothing
else from the device side. What it keeps per chunk for one window (early updates made, norms,
pending two-phase updates) lives in side tables here keyed by chunk index, not on the chunk.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from protrain.profiler.host_bytes import FP32_BYTES, WIDEN_SLICE_NUMEL
from protrain.profiler.plan import UpdateMode
from protrain.runtime.chunks.early_updates import Armed, Speculation
from protrain.runtime.chunks.grad_add import add_widened
from protrain.runtime.chunks.kept_gradients import KeptGradients
from protrain.runtime.chunks.store import Chunk, ChunkStore
from protrain.runtime.chunks.trace_labels import job_label
from protrain.runtime.chunks.waits import ExposedWaits
from protrain.runtime.hw.device import DeviceEvent, HostWorker, host_worker_threads
from protrain.runtime.hw.distributed import DistContext, all_reduce_sum_
from protrain.runtime.hw.host_memory import MmapArena
from protrain.runtime.optim.shard import GroupValues


class ChunkOptimizer:
    """The optimizer rule (AdamW unless the spec names another) over every trainable shard, early
    (speculative) for offloaded chunks; see the module docstring."""

    def __init__(self, *, store: ChunkStore, mode: UpdateMode, waits: ExposedWaits | None = None) -> None:
        """``mode``: how offloaded chunks are updated (the module docstring): early and on
        arrival during the window's last backward; two-phase after the step's norm, on the host
        worker, overlapping the next forward; deferred at the step."""
        self.store = store
        self.waits = waits if waits is not None else ExposedWaits()
        """Where the main thread's waits for the host worker are counted (``host``)."""
        self.mode = mode
        self.gradients = KeptGradients(None if store.tiers.nvme is None else store.tiers.nvme.gradients)
        self._norms_armed = False
        self._norm_squares: dict[int, torch.Tensor] = {}
        """Two-phase: each offloaded shard's squared gradient norm (float64), taken on the host
        worker as the window's last backward ended for it."""
        self._pending_updates: dict[int, DeviceEvent] = {}
        """Two-phase: the host worker's update of each offloaded chunk since the last drain."""
        self._worker = HostWorker("protrain-host-worker", threads=host_worker_threads(store.device))
        self._armed: Armed | None = None
        self._last_job: DeviceEvent | None = None
        """The last job queued on the host worker (every job runs in order)."""
        self._speculated: dict[int, Speculation] = {}
        """The early updates of this window, by chunk index."""
        self._zeroed: set[int] = set()
        """Chunks whose gradient the step zeroed right after their update (``zero_grads`` skips them)."""
        self.num_speculations = 0
        self.applies_on_arrival = any(c.training is not None and not c.keeps_gradient for c in store.trainable_chunks())
        """Offloaded chunks keep no gradient shard: each reduced gradient is applied as it arrives."""
        self._held: dict[int, dict[int, torch.Tensor]] = {}
        """Applied on arrival, several ranks: per chunk and segment position, the reduced gradient of
        a segment that had none here, until the step says whether another rank had one."""
        self._widen: MmapArena | None = None
        self._widened: torch.Tensor | None = None
        """Offloaded trainable chunks in a compute dtype other than fp32: the fp32 scratch a staged
        gradient is widened into (one: the host worker runs one job at a time): a whole shard
        for CPU Adam when applied on arrival, a slice before each add when kept (grad_add.py)."""
        offloaded = any(not c.persistent for c in store.trainable_chunks())
        if offloaded and store.compute_dtype != torch.float32:
            shard = store.layout.shard_numel
            numel = shard if self.applies_on_arrival else min(shard, WIDEN_SLICE_NUMEL)
            self._widen = MmapArena(numel * FP32_BYTES)
            self._widened = self._widen.allocate(numel, torch.float32)

    def trainable_chunks(self) -> Iterator[Chunk]:
        return self.store.trainable_chunks()

    # ------------------------------------------------------------------ the sink of reduced gradients

    def add_staged(
        self,
        chunk: Chunk,
        staged: torch.Tensor,
        copied: DeviceEvent,
        release: Callable[[], None],
        fired: torch.Tensor,
    ) -> DeviceEvent:
        if not chunk.keeps_gradient:
            return self._apply_on_arrival(chunk, staged, copied, release, fired)

        def add() -> None:
            copied.wait()  # the copy into the staging buffer has landed
            with torch.no_grad(), job_label("host_add", chunk.index), self.gradients.held(chunk, writes=True) as grad:
                add_widened(grad, staged, self._widened)
            release()

        return self._submit(add)

    @property
    def widening_bytes(self) -> int:
        """The host bytes of the fp32 scratch shard staged gradients are widened into (if any)."""
        return 0 if self._widen is None else self._widen.capacity_bytes

    def accepting(self) -> bool:
        return not self.applies_on_arrival or self._armed is not None

    def _submit(self, job: Callable[[], None]) -> DeviceEvent:
        self._last_job = self._worker.submit(job)
        return self._last_job

    def drain(self) -> None:
        """Wait for every job queued on the host worker (gradient adds, early updates)."""
        if self._last_job is not None:
            with self.waits.timing("host"):
                self._last_job.wait()
            self._last_job = None
        self._pending_updates.clear()

    def pending_update(self, chunk_index: int) -> DeviceEvent | None:
        """Two-phase: the event of the chunk's update still queued on the host worker, if any
        (a gather of the chunk must wait for it)."""
        return self._pending_updates.get(chunk_index)

    def reduction_queued(self, chunk: Chunk, reduced: DeviceEvent, fired: torch.Tensor) -> None:
        if not chunk.keeps_gradient:
            return  # applied as it arrived (add_staged), or no rank had a gradient here
        if self._norms_armed and not chunk.persistent:
            # After the chunk's adds on the same worker: its gradient is complete for the window
            # (and an NVMe chunk's still in its buffer: the step's norm would read it back).
            if self.mode is UpdateMode.TWO_PHASE or self.gradients.in_file(chunk):
                self._submit(lambda: self._take_norm(chunk))
            return
        armed = self._armed
        if armed is not None and not chunk.persistent:
            active = [bool(fired[s.param]) for s in chunk.segments]
            self._submit(lambda: self._speculate(chunk, reduced, active, armed))

    # ------------------------------------------------------------------ speculative CPU Adam

    def may_speculate(self) -> bool:
        """Whether an offloaded trainable chunk can be updated early at all."""
        early = self.mode in (UpdateMode.EARLY, UpdateMode.ON_ARRIVAL)
        return early and any(not c.persistent for c in self.trainable_chunks())

    def arm(self, *, lr: GroupValues, agreed: DeviceEvent, any_nonfinite: torch.Tensor) -> None:
        """The coming backward ends the window: update offloaded chunks as their gradients arrive,
        once ``agreed`` says the ranks' all-reduce of ``any_nonfinite`` is in. A non-finite loss
        on any rank skips the step, so then nothing is updated early; an early update is final
        (windows that may be clipped never update early). A parameter that had no gradient here
        but had one on another rank is simply updated at the step (segments are updated
        independently)."""
        self._armed = Armed(lr=lr, agreed=agreed, any_nonfinite=any_nonfinite)
        self._read_ahead(descending=True)

    def _read_ahead(self, *, descending: bool) -> None:
        if self.store.tiers.nvme is not None:
            self.store.tiers.nvme.read_ahead(descending=descending)

    def disarm(self) -> None:
        """Backward is over: no more early updates this window (queued ones finish on their own;
        ``step`` waits for them)."""
        self._armed = None
        self._norms_armed = False

    def arm_norms(self) -> None:
        """Two-phase: the coming backward ends the window; take each offloaded shard's squared
        norm as its gradient completes."""
        self._norms_armed = True

    @torch.no_grad()
    def _take_norm(self, chunk: Chunk) -> None:
        # The same fp32 pass and float64 square as ``grad_norm`` takes on the main thread.
        with job_label("norm", chunk.index), self.gradients.held(chunk, writes=False) as grad:
            square = torch.linalg.vector_norm(grad).double().cpu().square()
        self._norm_squares[chunk.index] = square

    def _speculate(self, chunk: Chunk, reduced: DeviceEvent, active: list[bool], armed: Armed) -> None:
        """On the host worker: wait for the ranks' agreement and the chunk's reduced gradient,
        update. One thread, so it does not take the cores backward uses."""
        armed.agreed.wait()
        if float(armed.any_nonfinite) > 0:
            return  # the step will be skipped on every rank
        reduced.wait()
        with job_label("adam", chunk.index), self.gradients.held(chunk, writes=False) as grad:
            if self.gradients.in_file(chunk):  # its norm while it is here, for the step's
                self._norm_squares[chunk.index] = torch.linalg.vector_norm(grad).double().cpu().square()
            self._update_shard(chunk, grad, active, armed.lr, in_backward=True)
        self._speculated[chunk.index] = Speculation(active=active)
        self.num_speculations += 1

    # ------------------------------------------------------------------ applied on arrival

    def _apply_on_arrival(
        self,
        chunk: Chunk,
        staged: torch.Tensor,
        copied: DeviceEvent,
        release: Callable[[], None],
        fired: torch.Tensor,
    ) -> DeviceEvent:
        """The host worker's jobs for a chunk with no gradient shard: AdamW from the staged
        gradient once the ranks agreed the window is not skipped. Returns the event after which
        the staging buffer is free: in a compute dtype other than fp32 once the gradient is
        widened into the scratch shard (a job of its own, so that the side stream's next copy
        into the buffer waits for the widening, not for CPU Adam); in fp32 Adam reads the buffer
        itself, so after the update (the ring has a third buffer for that slack)."""
        armed = self._armed
        assert armed is not None, "the reducer refuses gradients outside an armed backward"
        active = [bool(fired[s.param]) for s in chunk.segments]
        hold = self.store.dist_ctx.world_size > 1 and not all(active)
        widen = staged.dtype != torch.float32
        taken: list[torch.Tensor] = []

        @torch.no_grad()
        def take() -> None:
            copied.wait()  # the reduced gradient has landed in the staging buffer
            if widen:
                with job_label("host_add", chunk.index):
                    taken.append(self._fp32(staged))
                release()
            else:
                taken.append(staged)

        @torch.no_grad()
        def update() -> None:
            if not taken:
                return  # taking it failed (the error is on its own job's event)
            grad = taken[0]
            armed.agreed.wait()
            if float(armed.any_nonfinite) > 0:
                return  # the step will be skipped on every rank
            # The window's gradient norm (logged every update) needs this gradient's square.
            self._norm_squares[chunk.index] = torch.linalg.vector_norm(grad).double().square()
            with job_label("adam", chunk.index):
                self._update_shard(chunk, grad, active, armed.lr, in_backward=True)
            if hold:
                self._held[chunk.index] = {
                    position: grad[s.shard_offset : s.shard_offset + s.numel].clone()
                    for position, (s, done) in enumerate(zip(chunk.segments, active, strict=True))
                    if not done
                }
            if any(active):  # nothing changed otherwise: nothing a failed window would tear
                self._speculated[chunk.index] = Speculation(active=active)
                self.num_speculations += 1

        if widen:
            freed = self._submit(take)
            self._submit(update)
            return freed

        def take_and_update() -> None:
            try:
                take()
                update()
            finally:
                release()

        return self._submit(take_and_update)

    def _fp32(self, staged: torch.Tensor) -> torch.Tensor:
        if staged.dtype == torch.float32:
            return staged
        assert self._widened is not None, "a scratch shard exists for a compute dtype other than fp32"
        widened = self._widened[: staged.numel()]
        widened.copy_(staged)
        return widened

    def _apply_held(self, chunk: Chunk, wanted: list[bool], lr: GroupValues) -> None:
        """At the step: the segments another rank's gradient made active, from the gradients
        held for them (applied on arrival, several ranks)."""
        held = self._held.pop(chunk.index, {})
        grad = torch.zeros(chunk.numel, dtype=torch.float32)
        for position, want in enumerate(wanted):
            if want:
                segment = chunk.segments[position]
                grad[segment.shard_offset : segment.shard_offset + segment.numel].copy_(held[position])
        self._update_shard(chunk, grad, wanted, lr, in_backward=False)

    def finish_speculation(self) -> None:
        """Wait for the host worker (gradient adds and early updates, in order); no more
        speculation in this window."""
        self._armed = None
        self.drain()

    def speculation_undoable(self) -> bool:
        """Whether the window can still be dropped: no early update was made in it (early
        updates keep no undo state)."""
        return not self._speculated

    def discard_speculation(self) -> None:
        """The window's update is dropped (skipped): wait for the host worker; an early update
        already made cannot be undone, so that is an error (the ranks' agreement on a
        non-finite loss before the last backward keeps it from happening)."""
        self.finish_speculation()
        self._held.clear()
        if self._speculated:
            chunks = sorted(self._speculated)
            raise RuntimeError(f"chunks {chunks} were updated early and cannot be undone")

    # ------------------------------------------------------------------ the update

    def grad_norm(self, dist_ctx: DistContext) -> float:
        """The global gradient norm (the caller drained the collective queue and the host
        worker), from the squares the host worker took where it took them (two-phase)."""
        squares = torch.zeros((), dtype=torch.float64)
        for chunk in self.trainable_chunks():
            # One fp32 pass per shard (as clip_grad_norm_ takes per-tensor norms); the sum of
            # squares across shards and ranks in float64.
            square = self._norm_squares.get(chunk.index)
            if square is None and not chunk.keeps_gradient:
                continue  # applied on arrival, and no gradient arrived here this window
            if square is None:
                with self.gradients.held(chunk, writes=False) as grad:
                    square = torch.linalg.vector_norm(self._own_share(chunk, grad, dist_ctx)).double().cpu().square()
            squares += square
        all_reduce_sum_(squares, dist_ctx)
        return math.sqrt(float(squares))

    def _own_share(self, chunk: Chunk, grad: torch.Tensor, dist_ctx: DistContext) -> torch.Tensor:
        """The gradient this rank's norm counts: its shard, or of a replicated chunk (whose whole
        gradient every rank holds) the slice its shard would be, so the ranks split the pass
        and the squares sum as the sharded chunk's do."""
        if not chunk.is_replicated:
            return grad
        shard_numel = self.store.layout.shard_numel
        return grad[dist_ctx.rank * shard_numel : (dist_ctx.rank + 1) * shard_numel]

    def scale_grads_(self, factor: float) -> None:
        self._norm_squares.clear()  # taken before the scaling
        for chunk in self.trainable_chunks():
            with self.gradients.held(chunk, writes=True) as grad:
                grad.mul_(factor)

    def step(
        self,
        *,
        lr: GroupValues,
        active: torch.Tensor,
        grad_factors: tuple[float, ...] = (),
        then: Callable[[int], None] = lambda _: None,
    ) -> None:
        """The optimizer rule on every trainable shard (``active``: per parameter, whether any rank produced a
        gradient this window), each gradient multiplied by ``grad_factors`` first (unscale,
        clip), in that order. A chunk updated early is updated here only in the segments another
        rank's gradient made active. Two-phase: offloaded chunks
        are updated (and their gradients zeroed) on the host worker, in forward order.
        ``then(chunk index)`` follows each trainable chunk's turn, updated or not."""
        self.finish_speculation()
        if self.mode.updates_after_norm:
            self._read_ahead(descending=False)
        for chunk in self.trainable_chunks():
            self._step_chunk(chunk, lr=lr, active=active, grad_factors=grad_factors)
            then(chunk.index)
        self._norm_squares.clear()

    def _step_chunk(
        self, chunk: Chunk, *, lr: GroupValues, active: torch.Tensor, grad_factors: tuple[float, ...]
    ) -> None:
        wanted = [bool(active[s.param]) for s in chunk.segments]
        speculation = self._speculated.pop(chunk.index, None)
        if speculation is not None:
            # Only another rank's gradient can make a segment active that was not active
            # here; such a segment was left untouched early, so update just those now.
            wanted = [want and not done for want, done in zip(wanted, speculation.active, strict=True)]
            if not any(wanted):
                return
        if not chunk.keeps_gradient:
            if any(wanted):
                self._apply_held(chunk, wanted, lr)
            return
        # A direct-gradient shard is not zeroed: the next window's gradients are copied over it.
        zero = not self.store.direct_grads(chunk)
        if self.mode is UpdateMode.TWO_PHASE and not chunk.persistent:
            job = self._updater(chunk, wanted, lr, grad_factors, zero=zero)
            self._pending_updates[chunk.index] = self._submit(job)
        else:  # its gradient zeroed at once, still in cache (and under the early refreshes)
            self._updater(chunk, wanted, lr, grad_factors, zero=zero)()
            self._zeroed.add(chunk.index)

    def _updater(
        self, chunk: Chunk, wanted: list[bool], lr: GroupValues, grad_factors: tuple[float, ...], *, zero: bool
    ) -> Callable[[], None]:
        @torch.no_grad()
        def update() -> None:
            with job_label("adam", chunk.index), self.gradients.held(chunk, writes=not zero) as grad:
                for factor in grad_factors:
                    grad.mul_(factor)
                self._update_shard(chunk, grad, wanted, lr, in_backward=False)
            if zero:
                self.gradients.zero(chunk, grad)

        return update

    def _update_shard(
        self, chunk: Chunk, grad: torch.Tensor, active: list[bool], lr: GroupValues, *, in_backward: bool
    ) -> None:
        """The rule's kernel over the chunk's shard (an NVMe chunk's state in its slot meanwhile,
        and its compute copy refreshed when its master is there too)."""
        nvme = self.store.tiers.nvme
        copy_out = chunk.master if chunk.master_on_nvme else None
        with contextlib.nullcontext() if nvme is None else nvme.updating(chunk.index, descending=in_backward):
            chunk.optimizer.step_(grad, active, lr=lr, copy_out=copy_out)

    def zero_grads(self) -> None:
        """Zero every gradient shard (the two-phase updates zero theirs on the host worker)."""
        if not self._pending_updates:
            self.drain()  # no add into a shard may still be running
        self._norm_squares.clear()
        self._held.clear()
        zeroed, self._zeroed = self._zeroed, set()
        for chunk in self.trainable_chunks():
            if chunk.index in self._pending_updates or not chunk.keeps_gradient or chunk.index in zeroed:
                continue
            if not self.store.direct_grads(chunk):  # direct: copied over next window (reduce.py)
                self.gradients.zero(chunk)

    def close(self) -> None:
        self._worker.close()
        if self._widen is not None:
            self._widened = None
            self._widen.close()

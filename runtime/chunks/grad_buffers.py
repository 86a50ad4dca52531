"""Chunk-sized gradient buffers for one backward, reused instead of allocated per chunk.

Backward copies each parameter's gradient into its chunk's full-size buffer; once the chunk is
complete the side stream reduce-scatters the buffer into the fp32 shard. Allocating a new
buffer per chunk lets them pile up whenever reductions fall behind backward (one per chunk, 12
for 12 chunks, with every chunk persistent and a slow link in
tests/distributed/test_collectives_two_ranks.py), while the cost model counts one. With
offloaded chunks backward's own gathers queue behind the reductions and pace it, so there the
pile-up stays small. The pool instead hands a buffer back
once its reduction has run: past the pool's capacity (two buffers, so one fills while the
previous one is reduced; up to two more where the budget has room beyond the predicted peak:
``gradient_buffer_count``) the next chunk waits for the oldest reduction in flight rather than
allocating another.

The bound is soft. A chunk that cannot be reduced yet (reductions go in a fixed order, and a
chunk with a parameter that has not reported holds up the ones behind it) keeps its buffer; with
no reduction in flight to wait for, the pool allocates another rather than wait forever, and
frees it again once its reduction has run. Buffers are dropped when backward ends, so forward's
peak does not carry them. The cost model counts one buffer: its predicted peak falls where
backward starts, when only the first chunk's buffer exists; a second one is taken once that
chunk's gradients are complete, by when the last block's activations are being freed.

Under stream chaos (stream_chaos.py) a buffer about to be reused is checked: its reduction must
have run (on CPU; on CUDA compute waits for it on the device, which the host cannot see without
synchronising), else ``StreamChaosError``; it is then filled with NaN before it is zeroed, so on
CUDA a reduction that still read it would sum NaN.
"""

from __future__ import annotations

from collections import deque

import torch

from protrain.runtime.hw import stream_chaos
from protrain.runtime.hw.device import DeviceEvent, DeviceInfo, SideStream

GRADIENT_BUFFERS = 2
"""One buffer filling while the previous chunk's is reduced: enough to overlap the two."""
MORE_GRADIENT_BUFFERS = 2
"""At most this many more where the budget has room for them beyond the predicted peak."""


def gradient_buffer_count(*, budget_bytes: int, peak_bytes: int | None, chunk_bytes: int, margin: float) -> int:
    """The pool's capacity: ``GRADIENT_BUFFERS``, plus up to ``MORE_GRADIENT_BUFFERS`` that fit
    between the predicted peak and the budget less its margin. On several ranks a reduction
    ends when the slower rank's gradient is in too: with two buffers the faster rank waits at
    every chunk the other is behind on, with a few more it waits once, when backward ends
    (GPT 6x512, all offloaded, 2 CPU ranks: 30 -> 5 ms of waits per step). The peak the cost
    model predicts falls where backward starts, with one buffer; a later one is taken once a
    chunk's backward is done, so room beyond the peak is room for it."""
    if peak_bytes is None or chunk_bytes <= 0:
        return GRADIENT_BUFFERS
    room = int(budget_bytes * (1 - margin)) - peak_bytes
    return GRADIENT_BUFFERS + max(0, min(MORE_GRADIENT_BUFFERS, room // chunk_bytes))


class GradientBufferPool:
    def __init__(
        self,
        *,
        numel: int,
        dtype: torch.dtype,
        device: DeviceInfo,
        stream: SideStream,
        capacity: int = GRADIENT_BUFFERS,
    ) -> None:
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.stream = stream
        self.capacity = capacity
        self._reducing: deque[tuple[DeviceEvent, torch.Tensor]] = deque()
        self.allocated = 0
        """Buffers alive now (filling or being reduced)."""
        self.most_allocated = 0
        """The most buffers alive at once since the pool was made (for tests and benchmarks)."""
        self._chaos = stream_chaos.enabled()

    def take(self, *, zeroed: bool = True) -> torch.Tensor:
        """A buffer (zeroed, unless the caller writes or zeroes every element itself): the oldest
        one whose reduction has run, a new one below capacity, or else the oldest one, whose
        reduction compute waits for here (the host on CPU, the compute stream on CUDA). Under
        stream chaos a buffer not zeroed is NaN, so an element the caller missed shows."""
        # Buffers allocated past capacity (nothing was in flight to wait for) are freed as soon
        # as their reduction has run, not kept for the rest of backward.
        while self.allocated > self.capacity and self._reducing and self._reducing[0][0].query():
            self._reducing.popleft()
            self.allocated -= 1
        if self._reducing and (self._reducing[0][0].query() or self.allocated >= self.capacity):
            event, buffer = self._reducing[0]
            self.stream.make_compute_wait(event)  # raises if the reduction failed
            self._reducing.popleft()
            if self._chaos:
                self._check_reduced(event)
                stream_chaos.poison_(buffer)
            return buffer.zero_() if zeroed else buffer
        self.allocated += 1
        self.most_allocated = max(self.most_allocated, self.allocated)
        if zeroed:
            return torch.zeros(self.numel, dtype=self.dtype, device=self.device.device)
        fresh = torch.empty(self.numel, dtype=self.dtype, device=self.device.device)
        if self._chaos:
            stream_chaos.poison_(fresh)
        return fresh

    def reducing(self, buffer: torch.Tensor, done: DeviceEvent) -> None:
        """``buffer`` is read by side-stream work until ``done``; it may be reused after that."""
        self._reducing.append((done, buffer))

    def release(self) -> None:
        """Drop every buffer: backward is over and the side stream has drained (the caller
        waited for it), so no work still reads them."""
        # Dropped, not reused: a reduction still running after a failure keeps its buffer alive
        # (its job holds it; on CUDA record_stream guards the memory), so nothing to check.
        self._reducing.clear()
        self.allocated = 0

    def _check_reduced(self, event: DeviceEvent) -> None:
        """A buffer about to be reused: its reduction has run. On CUDA the wait before reuse is
        the compute stream's (the device event may still be pending, rightly), so only the CPU,
        where compute is the host, can check it here."""
        if not self.device.is_cuda:
            stream_chaos.check_released(event, "a gradient buffer")

"""The pool of chunk gradient buffers backward fills: reuse, the wait for a reduction, the soft
bound. (tests/distributed/test_collectives_two_ranks.py counts the buffers of real training.)"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch

from protrain.runtime.chunks.grad_buffers import GradientBufferPool
from protrain.runtime.hw.device import DeviceEvent, DeviceInfo, SideStream

CPU = DeviceInfo(torch.device("cpu"), "gloo")


@pytest.fixture
def stream() -> Iterator[SideStream]:
    side = SideStream(CPU, name="test-reductions")
    yield side
    side.close()


@pytest.fixture
def pool(stream: SideStream) -> GradientBufferPool:
    return GradientBufferPool(numel=8, dtype=torch.float32, device=CPU, stream=stream, capacity=2)


def test_a_full_pool_waits_for_the_oldest_reduction_and_hands_its_buffer_back_zeroed(
    stream: SideStream, pool: GradientBufferPool
) -> None:
    first, second = pool.take(), pool.take()
    first.fill_(1.0)
    gate = threading.Event()
    pool.reducing(first, stream.submit(lambda: gate.wait(10)))  # a reduction still running
    taken: list[torch.Tensor] = []
    taker = threading.Thread(target=lambda: taken.append(pool.take()))
    taker.start()
    taker.join(0.3)
    assert taker.is_alive(), "took a third buffer instead of waiting for the reduction"
    gate.set()
    taker.join(10)
    assert taken[0] is first and not taken[0].any()
    assert pool.allocated == pool.most_allocated == 2 and second is not first


def test_a_finished_reduction_is_reused_before_allocating(pool: GradientBufferPool) -> None:
    first = pool.take()
    first.fill_(3.0)
    pool.reducing(first, DeviceEvent.completed())
    again = pool.take()
    assert again is first and not again.any() and pool.allocated == 1


def test_buffers_past_capacity_are_freed_once_reduced(pool: GradientBufferPool) -> None:
    held = [pool.take() for _ in range(3)]  # nothing in flight: the pool grows to 3
    for buffer in held:
        pool.reducing(buffer, DeviceEvent.completed())
    first = weakref.ref(held[0])
    del held, buffer
    again = pool.take()
    assert pool.allocated == 2 and first() is None, "a buffer past capacity was kept"
    assert not again.any()


def test_a_failed_reduction_is_raised_by_the_next_take(stream: SideStream, pool: GradientBufferPool) -> None:
    buffer = pool.take()

    def fail() -> None:
        raise OSError("link down")

    failed = stream.submit(fail)
    pool.reducing(buffer, failed)
    # Let the reduction run (and fail) first; polling query() would spin forever under lazy
    # stream chaos, which runs a job only once its event is waited on.
    with contextlib.suppress(RuntimeError):
        failed.wait()
    with pytest.raises(RuntimeError, match="side stream failed"):
        pool.take()  # its buffer would be the one to reuse


def test_with_nothing_to_wait_for_the_pool_grows_and_release_drops_everything(
    pool: GradientBufferPool,
) -> None:
    # Chunks reduce in a fixed order: ones that filled early hold their buffers until the chunk
    # ahead of them is complete, and no reduction is in flight to wait for.
    held = [pool.take() for _ in range(3)]
    assert len({t.data_ptr() for t in held}) == 3 and pool.allocated == 3
    for buffer in held:
        pool.reducing(buffer, DeviceEvent.completed())
    alive = [weakref.ref(buffer) for buffer in held]
    del held, buffer
    pool.release()
    assert pool.allocated == 0 and pool.most_allocated == 3
    assert all(ref() is None for ref in alive), "the pool still holds buffers after release"


def test_more_buffers_only_where_the_budget_has_room_beyond_the_predicted_peak() -> None:
    from protrain.runtime.chunks.grad_buffers import gradient_buffer_count

    mib = 1 << 20

    def count(budget: int, peak: int | None) -> int:
        return gradient_buffer_count(budget_bytes=budget * mib, peak_bytes=peak, chunk_bytes=4 * mib, margin=0.05)

    assert count(1000, 100 * mib) == 4  # room for many: two more at most
    assert count(100, 89 * mib) == 3  # 95 MiB usable, 6 beyond the peak: one more chunk
    assert count(100, 92 * mib) == 2  # 3 MiB beyond the peak: less than a chunk
    assert count(100, 99 * mib) == 2  # the peak already in the margin: never fewer than two
    assert count(1000, None) == 2  # a plan without a predicted peak: the two the model counts

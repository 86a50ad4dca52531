"""Stream chaos's parts (runtime/hw/stream_chaos.py): lazy jobs wait for their event, random delays
replay per seed, released buffers are poisoned and checked, a skipped step fails the run, the
swap copies mark their side-stream use. What it catches in training: test_stream_chaos_catches.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.profiler.plan import BlockMode
from protrain.runtime.activations import transfers as transfers_module
from protrain.runtime.activations.host_pool import HostActivationPool
from protrain.runtime.activations.records import ActivationStats
from protrain.runtime.activations.transfers import ActivationTransfers
from protrain.runtime.chunks.grad_buffers import GradientBufferPool
from protrain.runtime.hw import stream_chaos
from protrain.runtime.hw.device import DeviceEvent, DeviceInfo, HostWorker, SideStream
from protrain.runtime.hw.stream_chaos import StreamChaosError
from tests.helpers import lm_batches, tiny_gpt

CPU = DeviceInfo(torch.device("cpu"), "gloo")


@pytest.fixture
def side_stream(chaos: Callable[..., None]) -> Iterator[Callable[[str], SideStream]]:
    """Side streams built under a chaos mode, closed after the test."""
    made: list[SideStream] = []

    def build(mode: str) -> SideStream:
        chaos(mode)
        made.append(SideStream(CPU, name="test-chaos"))
        return made[-1]

    yield build
    for stream in made:
        stream.close()


# ------------------------------------------------------------------ the two modes


def test_lazy_mode_runs_a_job_only_once_its_event_or_a_later_one_is_waited_on(
    side_stream: Callable[[str], SideStream],
) -> None:
    stream = side_stream("lazy")
    ran: list[int] = []
    events = [stream.submit(lambda i=i: ran.append(i)) for i in range(3)]
    time.sleep(0.05)
    assert ran == [] and not any(event.query() for event in events), "query() must not ask for the work"
    events[1].wait()
    assert ran == [0, 1], "waiting on an event runs the jobs up to it, in order"
    time.sleep(0.05)
    assert ran == [0, 1] and not events[2].query()
    events[2].wait()
    assert ran == [0, 1, 2]


def test_lazy_mode_holds_host_worker_jobs_too(chaos: Callable[..., None]) -> None:
    chaos("lazy")
    worker = HostWorker(name="test-chaos-host")
    try:
        ran = threading.Event()
        event = worker.submit(ran.set)
        time.sleep(0.05)
        assert not ran.is_set() and not event.query()
        event.wait()
        assert ran.is_set()
    finally:
        worker.close()


def test_closing_a_lazy_stream_runs_what_is_queued(chaos: Callable[..., None]) -> None:
    chaos("lazy")
    stream = SideStream(CPU, name="test-chaos")
    ran: list[int] = []
    stream.submit(lambda: ran.append(1))
    stream.close()
    assert ran == [1]


def test_random_mode_delays_every_job_by_its_seeds_draws(chaos: Callable[..., None]) -> None:
    """Each job sleeps a draw (0-5 ms, a few 25 ms more) from the worker's own generator before it runs: the same
    seed replays the same delays, another seed or worker draws others, and torch's generator is
    never touched."""

    def delays(seed: int, name: str = "test-chaos") -> list[float]:
        chaos("1", seed)
        stream = SideStream(CPU, name=name)
        worker_chaos = stream._worker._chaos
        assert worker_chaos is not None
        slept = worker_chaos.slept  # the delays the worker drew and slept, in order
        order: list[int] = []
        events = [stream.submit(lambda i=i: order.append(len(slept))) for i in range(20)]
        events[-1].wait()
        stream.close()
        assert order == list(range(1, 21)), "each job runs after its own delay"
        assert {thread for thread, _ in slept} == {name}
        return [seconds for _, seconds in slept]

    rng_before = torch.random.get_rng_state()
    first = delays(seed=7)
    most = stream_chaos.MAX_DELAY_S + stream_chaos.LONG_DELAY_S
    assert all(0.0 <= s <= most for s in first) and len(set(first)) == 20
    chaos("1", 7)
    worker_chaos = stream_chaos.for_worker("test-chaos")
    assert worker_chaos is not None and not worker_chaos.lazy
    expected = [stream_chaos.draw_delay(worker_chaos.rng) for _ in range(20)]
    assert first == expected
    assert delays(seed=7) == first, "a seed replays"
    assert delays(seed=8) != first
    assert delays(seed=7, name="another-worker") != first, "each worker has its own generator"
    assert torch.equal(torch.random.get_rng_state(), rng_before)


def test_modes_are_read_from_the_environment(chaos: Callable[..., None]) -> None:
    chaos("0")
    assert not stream_chaos.enabled() and stream_chaos.for_worker("w") is None
    chaos("lazy")
    lazy = stream_chaos.for_worker("w")
    assert stream_chaos.enabled() and lazy is not None and lazy.lazy
    chaos("sometimes")
    with pytest.raises(ValueError, match="PROTRAIN_STREAM_CHAOS='sometimes' is not one of 0, 1, lazy"):
        stream_chaos.enabled()


# ------------------------------------------------------------------ poison


FLOATS = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
]
INTEGERS = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_poison_makes_floating_point_buffers_nan(dtype: torch.dtype) -> None:
    tensor = torch.zeros(8, dtype=dtype)
    stream_chaos.poison_(tensor)
    assert torch.isnan(tensor.to(torch.complex128 if dtype.is_complex else torch.float64)).all()


@pytest.mark.parametrize("dtype", INTEGERS, ids=str)
def test_poison_fills_integers_with_their_largest_value(dtype: torch.dtype) -> None:
    tensor = torch.zeros(8, dtype=dtype)
    stream_chaos.poison_(tensor)
    assert all(value == torch.iinfo(dtype).max for value in tensor.tolist())


def test_poison_sets_bools_and_fills_the_bytes_of_anything_else() -> None:
    flags = torch.zeros(8, dtype=torch.bool)
    stream_chaos.poison_(flags)
    assert flags.all()
    packed = torch.zeros(8, dtype=torch.float4_e2m1fn_x2)  # no fill kernel of its own
    stream_chaos.poison_(packed)
    assert (packed.view(torch.uint8) == 0xFF).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_a_poisoned_byte_buffer_reads_nan_in_every_float_dtype(dtype: torch.dtype) -> None:
    """Swap buffers are bytes; what is read back through a missing wait is a float tensor."""
    raw = torch.zeros(64, dtype=torch.uint8)
    stream_chaos.poison_(raw)
    assert torch.isnan(raw.view(dtype).to(torch.float64)).all()


# ------------------------------------------------------------------ pools


def test_gradient_pool_refuses_a_buffer_whose_reduction_is_pending(
    monkeypatch: pytest.MonkeyPatch, side_stream: Callable[[str], SideStream]
) -> None:
    stream = side_stream("lazy")
    pool = GradientBufferPool(numel=8, dtype=torch.float32, device=CPU, stream=stream, capacity=1)
    reduced = threading.Event()
    pool.reducing(pool.take(), stream.submit(reduced.set))
    monkeypatch.setattr(stream, "make_compute_wait", lambda event: None)  # the wait, forgotten
    with pytest.raises(StreamChaosError, match="a gradient buffer was handed back while work on it"):
        pool.take()
    assert not reduced.is_set()


def test_gradient_pool_reuse_after_the_wait_is_zeroed_under_chaos(
    side_stream: Callable[[str], SideStream],
) -> None:
    stream = side_stream("lazy")
    pool = GradientBufferPool(numel=8, dtype=torch.float32, device=CPU, stream=stream, capacity=1)
    first = pool.take()
    first.fill_(2.0)
    seen: list[float] = []
    pool.reducing(first, stream.submit(lambda: seen.append(first.sum().item())))
    again = pool.take()  # waits for the lazy reduction, which reads the gradients, not NaN
    assert again is first and seen == [16.0] and not again.any()


def test_gradient_pool_checks_nothing_without_chaos(side_stream: Callable[[str], SideStream]) -> None:
    """Zero cost when chaos is off: the same missing wait goes unnoticed (which is why chaos)."""
    stream = side_stream("0")
    pool = GradientBufferPool(numel=8, dtype=torch.float32, device=CPU, stream=stream, capacity=1)
    gate = threading.Event()
    pool.reducing(pool.take(), stream.submit(lambda: gate.wait(10)))
    stream.make_compute_wait = lambda event: None  # type: ignore[method-assign]
    try:
        assert not pool.take().any()
    finally:
        gate.set()


def test_host_pool_poisons_a_freed_buffer_and_refuses_one_still_being_written(
    side_stream: Callable[[str], SideStream],
) -> None:
    stream = side_stream("lazy")
    pool = HostActivationPool()
    try:
        buffer = pool.allocate(100)
        pending = stream.submit(lambda: None)
        with pytest.raises(StreamChaosError, match="a swap buffer was handed back"):
            pool.free(buffer, written_by=pending)
        assert pool.live_allocations == 1, "a refused free frees nothing"
        pending.wait()
        pool.free(buffer, written_by=pending)
        assert pool.live_allocations == 0 and (buffer == 0xFF).all()
    finally:
        pool.close()


def test_host_pool_without_chaos_leaves_freed_bytes_alone(chaos: Callable[..., None]) -> None:
    chaos("0")
    pool = HostActivationPool()
    try:
        buffer = pool.allocate(100)
        buffer.fill_(7)
        pool.free(buffer, written_by=DeviceEvent())  # never fires: unchecked when chaos is off
        assert (buffer == 7).all()
    finally:
        pool.close()


def swap_transfers() -> ActivationTransfers:
    return ActivationTransfers(
        device=CPU, store=None, stats=ActivationStats(), offloads=True, expected_ssd_bytes=0
    )


def test_a_swap_buffer_freed_before_its_copy_landed_fails_now_and_at_the_next_forward(
    chaos: Callable[..., None],
) -> None:
    """Autograd's release path swallows exceptions (a finaliser), so the failure sticks."""
    chaos("lazy")
    transfers = swap_transfers()
    try:
        activation = torch.randn(1024)
        record = transfers.send_away(activation.untyped_storage(), 0, BlockMode.SWAP)
        with pytest.raises(StreamChaosError):
            transfers.free_host(record)  # the copy to host is held back: still pending
        with pytest.raises(StreamChaosError):
            transfers.begin_forward()
        transfers.drop_outbound(record)  # the right order: wait for the copy, then free
        assert record.host is None
    finally:
        transfers.close_stream()


def test_a_swap_in_prefetched_but_never_used_reads_its_bytes_before_they_are_poisoned(
    chaos: Callable[..., None],
) -> None:
    """A record released with its swap-in still held back: the copy reads the host bytes first
    (the poison comes after), so nothing raises and the device buffer got the real bytes."""
    chaos("lazy")
    transfers = swap_transfers()
    try:
        activation = torch.randn(1024)
        record = transfers.send_away(activation.untyped_storage(), 0, BlockMode.SWAP)
        record.outbound.wait()
        assert transfers.arrived(record)
        transfers.start_inbound(record)  # a prefetch, held back by lazy chaos
        restored, host, inbound = record.restored, record.host, record.inbound
        assert isinstance(inbound, DeviceEvent) and not inbound.query()
        assert restored is not None and torch.isnan(restored.view(torch.float32)).all(), "NaN until it lands"
        transfers.drop_outbound(record)  # released unused (as autograd drops a saved tensor)
        assert inbound.query() and torch.equal(restored.view(torch.float32), activation)
        assert host is not None and (host == 0xFF).all() and record.host is None
        transfers.begin_forward()  # nothing failed
    finally:
        transfers.close_stream()


# ------------------------------------------------------------------ record_stream on the copies


def test_swap_copies_run_on_the_side_stream_through_the_marking_helper(
    monkeypatch: pytest.MonkeyPatch, chaos: Callable[..., None]
) -> None:
    """Out and back in, each copy runs on the side stream's thread through the helper that,
    on CUDA, marks both tensors used there (record_stream), with the buffers it must protect."""
    chaos("1")
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    helper = transfers_module._copy_on_side_stream

    def watched(destination: torch.Tensor, source: torch.Tensor, kind: str, block: int) -> None:
        calls.append((threading.current_thread().name, destination, source))
        helper(destination, source, kind, block)

    monkeypatch.setattr(transfers_module, "_copy_on_side_stream", watched)
    transfers = swap_transfers()
    try:
        activation = torch.randn(1024)
        record = transfers.send_away(activation.untyped_storage(), 0, BlockMode.SWAP)
        record.outbound.wait()
        assert transfers.arrived(record) and record.source is None
        host = record.host
        restored = transfers.bytes_back(record)
        assert torch.equal(restored.view(torch.float32), activation)
        (out_thread, out_dst, out_src), (in_thread, in_dst, in_src) = calls
        assert out_thread == in_thread == "protrain-activations"
        assert out_dst is host and out_src.untyped_storage().data_ptr() == activation.data_ptr()
        assert in_dst is restored and in_src is host
        transfers.drop_outbound(record)
    finally:
        transfers.close_stream()


class FakeTensor:
    """Enough of a tensor for the helper: where it lives, its record_stream calls, a copy."""

    def __init__(self, *, cuda: bool) -> None:
        self.is_cuda = cuda
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self.recorded: list[Any] = []
        self.copied_from: FakeTensor | None = None

    def record_stream(self, stream: Any) -> None:
        self.recorded.append(stream)

    def copy_(self, source: FakeTensor, non_blocking: bool = False) -> None:
        assert non_blocking
        self.copied_from = source


def test_the_copy_helper_records_the_current_stream_on_cuda_tensors_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA branch, which no CPU run takes: inside the job the current stream is the side
    stream, and that is the one recorded on the device tensor (a host tensor needs none)."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("side stream of", device))
    device_buffer, host_buffer = FakeTensor(cuda=True), FakeTensor(cuda=False)
    transfers_module._copy_on_side_stream(device_buffer, host_buffer, "swap_in", 0)  # type: ignore[arg-type]
    assert device_buffer.recorded == [("side stream of", torch.device("cuda", 0))]
    assert host_buffer.recorded == [] and device_buffer.copied_from is host_buffer
    transfers_module._copy_on_side_stream(host_buffer, device_buffer, "swap_out", 0)  # type: ignore[arg-type]
    assert len(device_buffer.recorded) == 2 and host_buffer.recorded == []


# ------------------------------------------------------------------ skipped steps


def test_refusing_a_skipped_step_only_under_chaos(chaos: Callable[..., None]) -> None:
    chaos("0")
    stream_chaos.refuse_skipped_step("a reason")
    chaos("lazy")
    with pytest.raises(StreamChaosError, match=r"a step was skipped \(a reason\)"):
        stream_chaos.refuse_skipped_step("a reason")


def nan_loss_step(tmp_path: Path) -> bool:
    engine = runtime.initialize(
        tiny_gpt(),
        config={"seed": 3, "micro_batch_size": 2, "on_nonfinite_loss": "skip", "output_dir": str(tmp_path)},
    )
    with engine:
        out = engine(**lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0))
        engine.backward(out.loss * float("nan"))
        return engine.step()


def test_a_step_skipped_for_a_nan_loss_fails_the_run_under_chaos(
    tmp_path: Path, chaos: Callable[..., None]
) -> None:
    chaos("0")
    assert nan_loss_step(tmp_path / "plain") is False
    chaos("1")
    with pytest.raises(StreamChaosError, match="non-finite loss in 1 of 1 micro-batches of update 1"):
        nan_loss_step(tmp_path / "chaos")

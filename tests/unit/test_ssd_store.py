"""The SSD activation tier's file layer: bytes come back bit-exact or a loud SsdIoError, the disk
holds what the stats say, and the run directory goes away however the process ends."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from protrain.runtime.activations.ssd_store import (
    BLOCK_BYTES,
    IO_MODE_BUFFERED,
    IO_MODE_DIRECT,
    ActivationFileStore,
    SsdIoError,
)
from protrain.runtime.hw.ssd_io import measure_disk_rates

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]
MODES = {"direct": None, "buffered": False}  # direct_io argument: None probes (tmp_path is a real disk)
MiB = 1 << 20

StoreFactory = Callable[..., ActivationFileStore]


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[StoreFactory]:
    """Stores under tmp_path/act (or a given root), closed at teardown."""
    stores: list[ActivationFileStore] = []

    def factory(root: Path | None = None, *, rank: int = 0, **kwargs: object) -> ActivationFileStore:
        store = ActivationFileStore(root or tmp_path / "act", rank=rank, **kwargs)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield factory
    for store in stores:
        with contextlib.suppress(SsdIoError):
            store.close()


def store_in_mode(open_store: StoreFactory, mode: str, **kwargs: object) -> ActivationFileStore:
    store = open_store(direct_io=MODES[mode], **kwargs)
    if mode == "direct" and not store.direct_io:
        pytest.skip(f"the filesystem of {store.run_dir} refuses O_DIRECT")
    return store


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs to fill up."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount command to make a small tmpfs to fill")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def gate_writes(
    store: ActivationFileStore, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    """Hold every write on its I/O thread until ``gate`` is set; ``started`` tells one is held."""
    gate, started = threading.Event(), threading.Event()
    write_file = store._write_file

    def held(path: Path, payload: torch.Tensor) -> int:
        started.set()
        gate.wait(10)
        return write_file(path, payload)

    monkeypatch.setattr(store, "_write_file", held)
    return gate, started


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def random_tensor(numel: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool()
    if dtype is torch.int64:
        return torch.randint(-(2**62), 2**62, (numel,), generator=generator, dtype=torch.int64)
    return torch.randn(numel, generator=generator).to(dtype)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def payload(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def files_in(run_dir: Path) -> list[Path]:
    return sorted(run_dir.iterdir())


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_is_bit_exact_for_odd_sizes_and_dtypes(open_store: StoreFactory, mode: str) -> None:
    # 1 MiB staging pieces: the 3 MiB + 5 payloads go in several aligned pieces plus a padded tail.
    store = store_in_mode(open_store, mode, staging_chunk_bytes=MiB)
    generator = torch.Generator().manual_seed(0)
    tensors = [
        random_tensor(numel, dtype, generator)
        for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.int64)
        for numel in (0, 1, 4095, 4096, 4097, 3 * MiB + 5)
    ]
    tensors += [torch.tensor(3.5), torch.randn(3, 5, 7, generator=generator)]
    files = [store.write(tensor) for tensor in tensors]
    # Every read in flight at once: a result that aliased a reused staging buffer would show here.
    pending = [store.read(file) for file in files]
    for tensor, file, read in zip(tensors, files, pending, strict=True):
        back = read.result()
        assert file.nbytes == tensor.numel() * tensor.element_size()
        assert back.dtype == torch.uint8 and back.shape == (file.nbytes,)
        assert torch.equal(back, as_bytes(tensor))
        assert torch.equal(back.view(tensor.dtype).reshape(tensor.shape), tensor)


@pytest.mark.parametrize("mode", MODES)
def test_files_on_disk_hold_the_bytes_padded_to_blocks_under_o_direct(
    open_store: StoreFactory, mode: str
) -> None:
    store = store_in_mode(open_store, mode)
    data = payload(20_000)
    file = store.write(data)
    file.wait_written()
    assert store.io_mode == {"direct": IO_MODE_DIRECT, "buffered": IO_MODE_BUFFERED}[mode]
    assert file.path.parent == store.run_dir and file.path.suffix == ".act"
    raw = file.path.read_bytes()
    padded = -(-20_000 // BLOCK_BYTES) * BLOCK_BYTES
    assert len(raw) == (padded if mode == "direct" else 20_000)
    assert raw[:20_000] == data.numpy().tobytes()
    assert raw[20_000:] == bytes(len(raw) - 20_000)  # the padding is zeros, not an older tensor's bytes


def test_run_dir_is_named_for_host_pid_and_rank(open_store: StoreFactory, tmp_path: Path) -> None:
    store = open_store(rank=3)
    assert (
        store.run_dir
        == (tmp_path / "act").resolve() / f"protrain-act-{socket.gethostname()}-{os.getpid()}-rank3"
    )
    assert store.run_dir.is_dir()


def test_stats_match_the_bytes_moved_and_on_disk(open_store: StoreFactory) -> None:
    store = open_store()
    sizes = [10, 5000, 70_000]
    files = [store.write(payload(n)) for n in sizes]
    for file in files:
        file.wait_written()
    disk_bytes = sum(path.stat().st_size for path in files_in(store.run_dir))
    stats = store.stats
    assert (stats.bytes_written, stats.files_written) == (sum(sizes), 3)
    assert stats.bytes_on_disk == stats.peak_bytes_on_disk == disk_bytes
    assert max(sizes) <= stats.peak_inflight_bytes <= sum(sizes)
    assert stats.write_seconds > 0 and stats.writes_cancelled == 0

    for file in files[:2]:
        store.read(file).result()
    store.release(files[2])
    stats = store.stats
    assert (stats.bytes_read, stats.files_read) == (5010, 2)
    assert stats.read_seconds > 0
    assert stats.bytes_on_disk == sum(path.stat().st_size for path in files_in(store.run_dir))
    assert stats.peak_bytes_on_disk == disk_bytes


# -- release and cancellation ----------------------------------------------------------------------


def test_release_unlinks_the_file_and_is_idempotent(open_store: StoreFactory) -> None:
    store = open_store()
    file = store.write(payload(5000))
    file.wait_written()
    assert file.path.exists()
    store.release(file)
    store.release(file)
    assert not file.path.exists() and store.stats.bytes_on_disk == 0
    with pytest.raises(ValueError, match="not a live file"):
        store.read(file)


def test_release_before_the_write_starts_cancels_it(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(io_workers=1)
    gate, started = gate_writes(store, monkeypatch)
    first = store.write(payload(5000))
    started.wait(5)
    second = store.write(payload(6000))  # queued behind the held write on the only I/O thread
    store.release(second)
    assert second.written()  # nothing left to wait for
    gate.set()
    first.wait_written()
    assert files_in(store.run_dir) == [first.path]
    stats = store.stats
    assert (stats.writes_cancelled, stats.files_written, stats.bytes_written) == (1, 1, 5000)


def test_release_during_the_write_unlinks_the_file_once_written(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    gate, started = gate_writes(store, monkeypatch)
    file = store.write(payload(5000))
    started.wait(5)
    store.release(file)
    gate.set()
    wait_until(file.written)
    assert files_in(store.run_dir) == []
    stats = store.stats
    assert (stats.files_written, stats.writes_cancelled, stats.bytes_on_disk) == (1, 0, 0)


# -- backpressure ------------------------------------------------------------------------------------


def test_discard_returns_once_the_files_are_off_the_disk(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed step's files, whatever state their writes are in, take no space once
    ``discard`` returns: the running write is awaited and unlinked, the queued one cancelled."""
    store = open_store(io_workers=1)
    written = store.write(payload(5000))
    written.wait_written()
    gate, started = gate_writes(store, monkeypatch)
    running = store.write(payload(5000))
    assert started.wait(5)
    queued = store.write(payload(5000))
    threading.Timer(0.1, gate.set).start()
    store.discard([written, running, queued])
    assert running.written() and queued.written()
    assert files_in(store.run_dir) == [] and store.stats.bytes_on_disk == 0
    assert store.stats.writes_cancelled == 1
    kept = store.write(payload(100))  # the store goes on
    assert torch.equal(store.read(kept).result(), payload(100))


def test_write_blocks_while_in_flight_bytes_would_exceed_the_limit(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(max_inflight_bytes=50_000, io_workers=1)
    gate, started = gate_writes(store, monkeypatch)
    files = [store.write(payload(20_000, seed=0))]
    started.wait(5)
    files.append(store.write(payload(20_000, seed=1)))  # 40,000 in flight: fits
    third = threading.Thread(target=lambda: files.append(store.write(payload(20_000, seed=2))))
    third.start()
    third.join(0.2)
    assert third.is_alive(), "a write that would put 60,000 bytes in flight must wait"
    gate.set()
    third.join(5)
    assert not third.is_alive()
    for seed, file in enumerate(files):
        assert torch.equal(store.read(file).result(), payload(20_000, seed=seed))
    assert store.stats.peak_inflight_bytes == 40_000
    # With nothing in flight, one tensor larger than the limit still goes.
    store.write(payload(200_000)).wait_written()
    assert store.stats.peak_inflight_bytes == 200_000


def test_many_queued_writes_stay_under_the_in_flight_limit(open_store: StoreFactory) -> None:
    store = open_store(max_inflight_bytes=64 << 10, io_workers=2)
    files = [store.write(payload(20_000, seed=i)) for i in range(40)]
    for file in files:
        file.wait_written()
    stats = store.stats
    assert 20_000 <= stats.peak_inflight_bytes <= 64 << 10
    assert (stats.files_written, stats.bytes_written) == (40, 800_000)


# -- failures ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct_io", [None, False], ids=["probed", "buffered"])
def test_a_full_disk_fails_the_write_with_enospc_and_leaves_no_partial_file(
    small_disk: Path, open_store: StoreFactory, direct_io: bool | None
) -> None:
    store = open_store(small_disk, direct_io=direct_io)
    file = store.write(payload(MiB))
    with pytest.raises(SsdIoError) as raised:
        file.wait_written()
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC
    assert str(file.path) in message and "write" in message and "No space left on device" in message
    assert files_in(store.run_dir) == []
    small = store.write(payload(1000))  # the space of the partial file came back
    assert torch.equal(store.read(small).result(), payload(1000))


def test_an_unawaited_write_failure_is_raised_by_the_next_write(
    small_disk: Path, open_store: StoreFactory
) -> None:
    store = open_store(small_disk)
    failed = store.write(payload(MiB))
    wait_until(failed.written)
    with pytest.raises(SsdIoError, match=re.escape(str(failed.path)) + ".*No space left on device"):
        store.write(payload(1000))
    store.write(payload(1000)).wait_written()  # told once; the store goes on
    store.close()


def test_close_raises_an_unseen_write_failure_and_still_removes_the_directory(
    small_disk: Path, open_store: StoreFactory
) -> None:
    store = open_store(small_disk)
    failed = store.write(payload(MiB))
    wait_until(failed.written)
    with pytest.raises(SsdIoError, match=re.escape(str(failed.path))):
        store.close()
    assert not store.run_dir.exists()
    store.close()


def test_close_ignores_the_failure_of_a_released_file(small_disk: Path, open_store: StoreFactory) -> None:
    store = open_store(small_disk)
    failed = store.write(payload(MiB))
    wait_until(failed.written)
    store.release(failed)
    store.close()
    assert not store.run_dir.exists()


def test_check_free_space_names_the_directory_and_the_bytes(
    open_store: StoreFactory, small_disk: Path
) -> None:
    store = open_store()
    store.check_free_space(0)
    store.check_free_space(MiB)
    needed = 1 << 62
    with pytest.raises(SsdIoError) as raised:
        store.check_free_space(needed)
    message = str(raised.value)
    assert str(store.run_dir) in message and f"{needed:,} bytes needed" in message
    assert re.search(r"[\d,]+ bytes free", message)

    small = open_store(small_disk)
    with pytest.raises(SsdIoError, match="bytes free"):
        small.check_free_space(MiB)


@pytest.mark.parametrize("mode", MODES)
def test_a_truncated_file_fails_the_read(open_store: StoreFactory, mode: str) -> None:
    store = store_in_mode(open_store, mode)
    file = store.write(payload(10_000))
    file.wait_written()
    os.truncate(file.path, 5000)
    with pytest.raises(SsdIoError) as raised:
        store.read(file).result()
    message = str(raised.value)
    assert str(file.path) in message and "read" in message and "truncated" in message
    assert store.stats.files_read == 0


def test_checksum_catches_a_flipped_byte(open_store: StoreFactory) -> None:
    store = open_store(checksum=True)
    file = store.write(payload(10_000))
    file.wait_written()
    assert torch.equal(store.read(file).result(), payload(10_000))  # intact: verifies
    with open(file.path, "r+b") as handle:
        handle.seek(1234)
        byte = handle.read(1)[0]
        handle.seek(1234)
        handle.write(bytes([byte ^ 0xFF]))
    with pytest.raises(SsdIoError, match="checksum mismatch") as raised:
        store.read(file).result()
    assert str(file.path) in str(raised.value)


def test_a_root_that_is_not_a_writable_directory_is_refused_clearly(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    for root in (not_a_dir, not_a_dir / "below"):
        with pytest.raises(SsdIoError, match=re.escape(str(root)) + ".*memory.ssd.path"):
            ActivationFileStore(root, rank=0)


def test_only_contiguous_cpu_tensors_are_accepted(open_store: StoreFactory) -> None:
    store = open_store()
    with pytest.raises(ValueError, match="contiguous"):
        store.write(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="meta"):
        store.write(torch.ones(4, device="meta"))


# -- lifetime of the run directory -------------------------------------------------------------------


def test_close_cancels_queued_writes_removes_the_directory_and_is_idempotent(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(io_workers=1)
    gate, started = gate_writes(store, monkeypatch)
    running = store.write(payload(5000))
    started.wait(5)
    queued = store.write(payload(5000))
    threading.Timer(0.05, gate.set).start()
    store.close()  # waits for the running write, drops the queued one
    assert running.written() and queued.written()
    with pytest.raises(SsdIoError, match="closed"):
        queued.wait_written()
    assert store.stats.writes_cancelled == 1
    assert not store.run_dir.exists()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.write(payload(10))


def test_a_store_dropped_without_close_removes_its_directory(tmp_path: Path) -> None:
    store = ActivationFileStore(tmp_path, rank=0)
    store.write(payload(5000)).wait_written()
    run_dir = store.run_dir
    del store
    gc.collect()
    # The I/O thread that finished the write may hold the last reference a moment longer.
    wait_until(lambda: not run_dir.exists())


def test_a_forked_child_leaves_the_parents_run_directory_alone(open_store: StoreFactory) -> None:
    store = open_store()
    file = store.write(payload(5000))
    file.wait_written()
    child = os.fork()
    if child == 0:  # what interpreter exit or garbage collection in the child would run
        try:
            store._finalizer()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert file.path.exists()
    assert torch.equal(store.read(file).result(), payload(5000))


def test_two_stores_of_one_process_and_rank_get_their_own_directories(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    """A teacher and a student (two engines, one process, one memory.ssd.path): each store has
    its own directory, their files interleave without mixing, closing one leaves the other's
    files readable, and nothing is left once both are closed."""
    teacher, student = open_store(rank=0), open_store(rank=0)
    assert student.run_dir == teacher.run_dir.with_name(f"{teacher.run_dir.name}-2")
    files = [
        (store, store.write(payload(5000 + i, seed=i)), i) for i in range(6) for store in (teacher, student)
    ]
    reads = [(store.read(file), i) for store, file, i in files]
    for read, i in reads:
        assert torch.equal(read.result(), payload(5000 + i, seed=i))
    assert len(files_in(teacher.run_dir)) == len(files_in(student.run_dir)) == 6

    teacher.close()
    assert not teacher.run_dir.exists()
    for store, file, i in files[1::2]:
        assert store is student and torch.equal(student.read(file).result(), payload(5000 + i, seed=i))
    third = open_store(rank=0)  # the first name is free again
    assert third.run_dir == teacher.run_dir
    third.close()
    student.close()
    assert list((tmp_path / "act").iterdir()) == []


@pytest.fixture
def live_pid() -> Iterator[int]:
    """The pid of another process that stays alive for the test."""
    process = subprocess.Popen(["sleep", "60"])
    yield process.pid
    process.kill()
    process.wait()


def test_remove_stale_removes_only_this_hosts_dirs_that_no_live_store_holds(
    tmp_path: Path, open_store: StoreFactory, live_pid: int
) -> None:
    ours_open = [open_store(tmp_path, rank=7), open_store(tmp_path, rank=7)]  # -rank7 and -rank7-2
    ours_files = [store.write(payload(5000)) for store in ours_open]
    for file in ours_files:
        file.wait_written()
    finished = subprocess.Popen(["true"])
    finished.wait()
    host = socket.gethostname()
    dead = [tmp_path / f"protrain-act-{host}-{finished.pid}-rank0{suffix}" for suffix in ("", "-2", "-13")]
    # Named for this process yet held by none of its stores: an earlier process with this pid.
    ours_unheld = tmp_path / f"protrain-act-{host}-{os.getpid()}-rank7-3"
    other_live = [tmp_path / f"protrain-act-{host}-{live_pid}-rank0{suffix}" for suffix in ("", "-2")]
    other_host = tmp_path / f"protrain-act-not-{host}-{finished.pid}-rank0"
    unrelated = [tmp_path / "keep-me", tmp_path / f"protrain-act-{host}-{finished.pid}-rank0-x"]
    for directory in (*dead, ours_unheld, *other_live, other_host, *unrelated):
        directory.mkdir()
        (directory / "00000000.act").write_bytes(b"x" * 10)

    assert ActivationFileStore.remove_stale(tmp_path) == sorted([*dead, ours_unheld])
    for directory in (*other_live, other_host, *unrelated):
        assert directory.exists(), directory
    for store, file in zip(ours_open, ours_files, strict=True):
        assert torch.equal(store.read(file).result(), payload(5000)), "open stores keep their files"
    assert ActivationFileStore.remove_stale(tmp_path / "missing") == []

    dead[1].mkdir()
    open_store(tmp_path, rank=0)  # a new store clears crashed runs first
    assert not dead[1].exists() and all(directory.exists() for directory in other_live)


def test_a_dir_left_by_an_earlier_process_with_this_pid_is_cleared(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    # A restarted container reuses pids: the name matches a live pid, yet no store of ours owns it.
    stale = [
        tmp_path / "act" / f"protrain-act-{socket.gethostname()}-{os.getpid()}-rank5{suffix}"
        for suffix in ("", "-2")
    ]
    for directory in stale:
        directory.mkdir(parents=True)
        (directory / "00000000.act").write_bytes(b"x" * 10)
    store = open_store(rank=5)
    assert store.run_dir == stale[0].resolve() and files_in(store.run_dir) == []
    assert not stale[1].exists()


# -- run directories of processes that end badly -----------------------------------------------------

_WRITER = """
import sys, time, torch
from protrain.runtime.activations.ssd_store import ActivationFileStore
store = ActivationFileStore(sys.argv[1], rank=0, max_inflight_bytes=4 << 20)
data = torch.ones(1 << 20, dtype=torch.uint8)
files = []
print(store.run_dir, flush=True)
def write_some():
    files.append(store.write(data))
    if len(files) > 8:
        store.release(files.pop(0))
for _ in range(4):
    write_some()
print("ready", flush=True)
if sys.argv[2] == "raise":
    raise RuntimeError("the training step failed")
while True:
    write_some()
"""


def start_writer(root: Path, ending: str) -> tuple[subprocess.Popen[str], Path]:
    process = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), ending],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "scripts")])},
    )
    assert process.stdout is not None
    run_dir = Path(process.stdout.readline().strip())
    assert process.stdout.readline().strip() == "ready", process.stderr.read() if process.stderr else ""
    return process, run_dir


def test_an_uncaught_exception_still_removes_the_run_directory(tmp_path: Path) -> None:
    process, run_dir = start_writer(tmp_path, "raise")
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 1 and "the training step failed" in stderr
    assert run_dir.parent == tmp_path.resolve() and not run_dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_sigint_while_writing_still_removes_the_run_directory(tmp_path: Path) -> None:
    process, run_dir = start_writer(tmp_path, "loop")
    assert run_dir.is_dir()
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode != 0 and "KeyboardInterrupt" in stderr
    assert not run_dir.exists()


def test_after_kill_9_the_next_store_on_the_root_removes_the_stale_directory(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    process, run_dir = start_writer(tmp_path, "loop")
    process.kill()
    process.communicate(timeout=30)
    assert run_dir.is_dir()  # nothing ran at exit: SIGKILL
    store = open_store(tmp_path)
    assert not run_dir.exists() and store.run_dir.is_dir()


def test_disk_rates_are_measured_and_leave_no_file(tmp_path: Path) -> None:
    write_bps, read_bps, mode = measure_disk_rates(tmp_path, nbytes=4 << 20, chunk_bytes=1 << 20)
    assert write_bps > 0 and read_bps > 0
    assert mode in (IO_MODE_DIRECT, IO_MODE_BUFFERED)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="multiple of 4096"):
        measure_disk_rates(tmp_path, nbytes=1 << 20, chunk_bytes=1000)

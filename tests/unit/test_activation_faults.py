"""The SSD tier through the engine: forwarding serves backward from memory, a disk that fills up
or a file that cannot be read back gives a clear error naming the path (never zeros), the free
space is checked before a step, and no activation file outlives the run: after normal exit, an
exception or Ctrl-C."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.runtime.activations.ssd_store import SsdIoError
from protrain.runtime.hw import ssd_io
from protrain_demo.gpt import GPTConfig
from tests.helpers import assert_state_equal, lm_batches, tiny_gpt

FOUR_BLOCKS = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=2, d_model=64)
ROOT = Path(__file__).resolve().parents[2]


def ssd_job(tmp_path: Path, ssd_path: Path, n_offload: int = 4) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3},
        # Every knob set: these tests are about the file store, not about planning (auto knobs
        # would profile on the first batch, measuring the disk before the test's fault).
        "memory": {
            "chunk_size": "256KiB",
            "n_persist": 0,
            "n_buffer": 2,
            "n_swap": 0,
            "n_checkpoint": 0,
            "ssd": {"path": str(ssd_path), "n_offload": n_offload},
        },
        "output_dir": str(tmp_path / "runs"),
    }


def batch(step: int) -> dict[str, torch.Tensor]:
    return lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(step, 0, 0)


def two_steps(config: dict[str, Any]) -> Any:
    """A four-block GPT engine built from ``config`` after two training steps (left open)."""
    engine = runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=config)
    for step in range(2):
        out = engine(**batch(step))
        engine.backward(out.loss)
        engine.step()
    return engine


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_writes_still_in_flight_are_served_from_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow disk: backward starts before the last blocks' files are written, takes those bytes
    from memory (forwarding) and drops the files, and trains exactly as with a fast disk."""
    fast = two_steps(ssd_job(tmp_path / "a", tmp_path / "ssd-a"))
    expected = fast.state_dict()
    fast.close()

    write_all = ssd_io._pwrite_all

    def slow_write(*args: Any) -> None:
        time.sleep(0.05)
        write_all(*args)

    monkeypatch.setattr(ssd_io, "_pwrite_all", slow_write)
    engine = two_steps(ssd_job(tmp_path / "b", tmp_path / "ssd-b"))
    stats = engine.activations.stats
    assert stats.forwarded > 0, "records still being written were served without a read"
    assert stats.bytes_from_ssd < stats.bytes_to_ssd
    assert_state_equal(engine.state_dict(), expected)
    run_dir = engine.activations.store.run_dir
    engine.close()
    assert not run_dir.exists()


def test_a_full_disk_raises_naming_the_path_and_cleans_up(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "96k") as disk:
        engine = runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=ssd_job(tmp_path, disk))
        run_dir = engine.activations.store.run_dir
        with pytest.raises(SsdIoError, match="No space left on device") as caught:
            out = engine(**batch(0))
            engine.backward(out.loss)
        assert str(disk) in str(caught.value)
        engine.close()
        assert not run_dir.exists()
        assert list(disk.iterdir()) == []


def disk_used_bytes(path: Path) -> int:
    """Bytes in use on ``path``'s filesystem as ``df`` counts them, not as the store tallies."""
    stat = os.statvfs(path)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def test_a_full_disk_has_its_space_back_when_the_error_is_raised(tmp_path: Path) -> None:
    """Something else fills the disk. The step's files go as the error is raised (not at close),
    though the caught error still holds the failed forward's graph; once space is freed the same
    engine runs the step again and trains exactly as one that never failed."""
    reference = two_steps(ssd_job(tmp_path / "a", tmp_path / "ssd-a"))
    expected = reference.state_dict()
    reference.close()
    with small_tmpfs(tmp_path / "small", "4m") as disk:
        engine = runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=ssd_job(tmp_path / "b", disk))
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - (128 << 10)))
        used_before_bytes = disk_used_bytes(disk)
        with pytest.raises(SsdIoError, match="No space left on device") as caught:
            out = engine(**batch(0))
            engine.backward(out.loss)
        assert disk_used_bytes(disk) == used_before_bytes, "the failed step's files were removed"
        assert list(engine.activations.store.run_dir.iterdir()) == []
        assert caught.value.__traceback__ is not None  # the graph it holds did not free them
        filler.unlink()  # the user frees space and goes on
        for step in range(2):
            out = engine(**batch(step))
            engine.backward(out.loss)
            engine.step()
        assert_state_equal(engine.state_dict(), expected)
        engine.close()
        assert list(disk.iterdir()) == []


def test_backward_through_a_graph_whose_files_were_dropped_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two graphs alive, the second forward fails on a full disk: the files of both go at once,
    and the first graph's backward says why its activations are gone instead of reading them."""
    engine = runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=ssd_job(tmp_path, tmp_path / "ssd"))
    store = engine.activations.store
    first = engine(**batch(0))

    def disk_full(*_args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ssd_io, "_pwrite_all", disk_full)
    with pytest.raises(SsdIoError, match="No space left on device"):
        engine(**batch(1))
    assert list(store.run_dir.iterdir()) == []
    with pytest.raises(SsdIoError, match=r"block \d+ were dropped when a step failed on an I/O error"):
        engine.backward(first.loss)
    engine.close()
    assert not store.run_dir.exists()


def test_free_space_is_checked_before_a_step(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "4m") as disk:
        engine = runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=ssd_job(tmp_path, disk))
        out = engine(**batch(0))
        engine.backward(out.loss)
        engine.step()
        written = engine.activations.stats.bytes_to_ssd
        # Something else fills the disk: the next step would not fit, and says so up front.
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - written // 2))
        writes_before = engine.activations.store.stats.files_written
        with pytest.raises(SsdIoError, match="bytes") as caught:
            engine(**batch(1))
        assert str(disk) in str(caught.value)
        assert engine.activations.store.stats.files_written == writes_before, "nothing was written"
        engine.close()
        (disk / "filler").unlink()


def test_a_file_that_cannot_be_read_back_raises_and_never_gives_zeros(tmp_path: Path) -> None:
    engine = runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=ssd_job(tmp_path, tmp_path / "ssd"))
    store = engine.activations.store
    out = engine(**batch(0))
    deadline = time.monotonic() + 10
    while store.stats.bytes_written < engine.activations.stats.bytes_to_ssd and time.monotonic() < deadline:
        time.sleep(0.01)
    for file in store.run_dir.iterdir():
        with open(file, "r+b") as handle:
            handle.truncate(100)  # someone else damaged the files
    with pytest.raises(SsdIoError, match="read") as caught:
        engine.backward(out.loss)
    assert str(store.run_dir) in str(caught.value)
    engine.close()
    assert not store.run_dir.exists()


SCRIPT = """
import sys, torch
from protrain import runtime
from protrain_demo.gpt import GPT, GPTConfig
from tests.helpers import lm_batches
config = {{"seed": 3, "micro_batch_size": 2, "optimizer": {{"lr": 1e-3}},
          "memory": {{"ssd": {{"path": {ssd!r}, "n_offload": 4}}}}, "output_dir": {out!r}}}
engine = runtime.initialize(GPT(GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=2, d_model=64)),
                            config=config)
data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
step = 0
while True:
    out = engine(**data.batch(step, 0, 0))
    if {fail!r} == "exception" and step == 1:
        raise RuntimeError("the training script failed")
    engine.backward(out.loss)
    engine.step()
    step += 1
    if step == 1:
        print("ready", flush=True)
"""


@pytest.mark.parametrize("ending", ["exception", "sigint"])
def test_no_activation_file_survives_a_failing_or_interrupted_script(tmp_path: Path, ending: str) -> None:
    ssd = tmp_path / "ssd"
    code = SCRIPT.format(ssd=str(ssd), out=str(tmp_path / "runs"), fail=ending)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not lines or lines[-1] != "ready":
            line = proc.stdout.readline()
            assert line, f"the script ended early: {lines}"
            lines.append(line.strip())
        assert any("activation files under" in line for line in lines), "the I/O mode is logged"
        if ending == "sigint":
            time.sleep(0.2)  # somewhere inside a later step
            proc.send_signal(signal.SIGINT)  # once: the engine stops at the end of that step
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    if ending == "sigint":
        assert proc.returncode == 130, stderr[-2000:]
        assert "stopped at update" in stdout, stdout[-2000:]
    else:
        assert proc.returncode != 0
        assert "the training script failed" in stderr, stderr[-2000:]
    assert ssd.exists() and list(ssd.iterdir()) == [], "the run directory was removed"

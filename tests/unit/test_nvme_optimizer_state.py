"""Optimizer state on NVMe (``memory.ssd.n_optimizer``, issue 31): the last offloaded chunks keep
their optimizer state in files under ``memory.ssd.path``, read into a host slot ahead of each
update and written behind it. Training equals training with the state in host memory bit for
bit (fp32 and bf16, clipping on and off, accumulation 1 and 2, another rule); the state is
really in the files (read there, not from the runtime); checkpoints save from the files and
resume onto another ``n_optimizer`` or none; a plan switch moves the state in and out of the
files; a full disk is refused before training, a file cut short behind the engine's back fails
naming it, and no file outlives its engine (closed, dropped, or its process interrupted)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.profiler.host_bytes import nvme_file_bytes, offloaded_region_bytes
from protrain.runtime.chunks.nvme_state import RUN_DIR_PREFIX
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.hw.ssd_io import SsdIoError
from tests.checkpointing import checkpoint_job, train_until
from tests.helpers import assert_state_equal, lm_batches, tiny_gpt, train_reference, train_updates
from tests.unit.test_activation_faults import small_tmpfs

pytestmark = pytest.mark.timeout(180)

STEPS = 4
NVME_CHUNKS = 4
"""Of the tiny GPT's 11 offloaded 64 KiB chunks: more than the three host slots, so two chunks
share a slot and are read from their files every update."""


def job(root: Path, *, n_optimizer: int, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {
            "chunk_size": "64KiB",
            "n_persist": 1,
            "n_buffer": 2,
            "block_modes": ["keep", "keep"],
            "ssd": {"path": str(root / "nvme"), "n_optimizer": n_optimizer},
        },
        "output_dir": str(root / "runs"),
    }
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and key in spec else value
    return spec


def train(root: Path, *, n_optimizer: int, accumulation: int = 1, **overrides: Any) -> dict[str, Any]:
    data = lm_batches(micro_batch_size=2, accumulation=accumulation, world_size=1)
    spec = job(root, n_optimizer=n_optimizer, gradient_accumulation_steps=accumulation, **overrides)
    losses: list[float] = []
    with runtime.initialize(tiny_gpt(0), config=spec) as engine:
        nvme = engine.chunks.store.tiers.nvme
        files: dict[str, int] = {}
        if nvme is not None:
            files = {path.name: path.stat().st_size for path in nvme.run_dir.iterdir()}
        for update in range(STEPS):
            for micro in range(accumulation):
                out = engine(**data.batch(update, micro, 0))
                engine.backward(out.loss)
                losses.append(out.loss.item())
                engine.step()
        counters = None if nvme is None else nvme.counters
        run_dir = None if nvme is None else nvme.run_dir
        return {"state": engine.state_dict(), "losses": losses, "counters": counters, "files": files, "dir": run_dir}


CASES = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "accumulation-2": {"accumulation": 2},
    "clipped": {"gradient_clipping": 0.05},
    "bf16-clipped": {"precision": "bf16", "gradient_clipping": 0.05},
    "lion": {"optimizer": {"type": "lion", "lr": 1e-4}},
}


def expected_io(case: dict[str, Any]) -> tuple[int, int]:
    """(reads, writes) of the tier's files over the run. State: every update writes each NVMe
    chunk's back; the chunks alone in their slot are read once, the two sharing one every update.
    Kept gradients (nvme_grads.py): written by every micro-batch's add; read by each add after a
    window's first, and by the update unless a buffer still holds it (the first two chunks the
    update reaches) or, updated early, it follows the add."""
    reads, writes = NVME_CHUNKS + 2 * (STEPS - 1), STEPS * NVME_CHUNKS
    if "gradient_clipping" in case:  # one micro-batch; updated at the step
        return reads + STEPS * (NVME_CHUNKS - 2), writes + STEPS * NVME_CHUNKS
    if case.get("accumulation", 1) == 2:  # the second micro-batch reads each; updated early
        return reads + STEPS * NVME_CHUNKS, writes + 2 * STEPS * NVME_CHUNKS
    return reads, writes


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_state_on_nvme_trains_bit_identically(tmp_path: Path, case: dict[str, Any]) -> None:
    in_memory = train(tmp_path / "ram", n_optimizer=0, **case)
    on_nvme = train(tmp_path / "nvme", n_optimizer=NVME_CHUNKS, **case)
    assert_state_equal(on_nvme["state"], in_memory["state"])
    assert on_nvme["losses"] == in_memory["losses"]
    counters, files = on_nvme["counters"], on_nvme["files"]
    # One state file per NVMe chunk (and a gradient file when gradients are kept), each tensor
    # 4 KiB-aligned.
    kept = "gradient_clipping" in case or case.get("accumulation", 1) > 1
    assert len(files) == NVME_CHUNKS * (2 if kept else 1)
    assert all(size % 4096 == 0 and size > 0 for size in files.values())
    assert (counters.reads, counters.writes) == expected_io(case)
    state_bytes = sum(size for name, size in files.items() if name.endswith(".state"))
    grad_bytes = sum(size for name, size in files.items() if name.endswith(".grad"))
    grad_writes = counters.writes - STEPS * NVME_CHUNKS
    assert counters.bytes_written == STEPS * state_bytes + grad_writes // NVME_CHUNKS * grad_bytes
    assert not on_nvme["dir"].exists(), "the engine's files went when it closed"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kept_gradients_are_in_the_files(tmp_path: Path, precision: str) -> None:
    """Mid-window (accumulation 2, the first micro-batch's backward done) each NVMe chunk's
    gradient, read from its file with plain file I/O, is the in-memory run's gradient shard; the
    host holds no gradient shard of those chunks, only the tier's two buffers of a chunk each."""
    data = lm_batches(micro_batch_size=2, accumulation=2, world_size=1)

    def first_micro_batch(engine: Any) -> None:
        engine.backward(engine(**data.batch(0, 0, 0)).loss)
        engine.chunks.drain()

    spec = job(tmp_path / "ram", n_optimizer=0, precision=precision, gradient_accumulation_steps=2)
    with runtime.initialize(tiny_gpt(0), config=spec) as plain:
        first_micro_batch(plain)
        expected = {c.index: c.grad_shard.clone() for c in plain.chunks.chunks if c.training is not None}
    spec = job(tmp_path / "nvme", n_optimizer=NVME_CHUNKS, precision=precision, gradient_accumulation_steps=2)
    with runtime.initialize(tiny_gpt(0), config=spec) as engine:
        first_micro_batch(engine)
        nvme = engine.chunks.store.tiers.nvme
        assert nvme is not None and nvme.gradients is not None
        nvme.drain()
        on_nvme = [chunk for chunk in engine.chunks.chunks if chunk.state_on_nvme]
        assert len(on_nvme) == NVME_CHUNKS
        for chunk in on_nvme:
            assert chunk.training is not None and chunk.training.grad_shard is None
            path = nvme.run_dir / f"chunk{chunk.index:05d}.grad"
            raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)
            assert torch.equal(raw[: chunk.master.numel()], expected[chunk.index])
        assert nvme.gradients.buffer_bytes == 2 * engine.chunks.layout.shard_numel * 4
        engine.step()  # the window ends normally


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_state_is_in_the_files(tmp_path: Path, precision: str) -> None:
    """Read from the files with plain file I/O (not through the tier): each NVMe chunk's moments
    are the in-memory run's, and in bf16 its fp32 master too (first), the host keeping only the
    master's bf16 copy; the host slots are not where any of it is kept."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    spec = job(tmp_path / "ram", n_optimizer=0, precision=precision)
    with runtime.initialize(tiny_gpt(0), config=spec) as plain:
        train_updates(plain, data, range(STEPS))
        expected = {
            chunk.index: ([chunk.master.clone()] if precision == "bf16" else [])
            + [t.clone() for t in chunk.training.optimizer.states]
            for chunk in plain.chunks.chunks[1:]
        }
    spec = job(tmp_path / "nvme", n_optimizer=NVME_CHUNKS, precision=precision)
    with runtime.initialize(tiny_gpt(0), config=spec) as engine:
        train_updates(engine, data, range(STEPS))
        nvme = engine.chunks.store.tiers.nvme
        assert nvme is not None
        nvme.drain()
        on_nvme = [chunk for chunk in engine.chunks.chunks if chunk.state_on_nvme]
        count = len(engine.chunks.chunks)
        assert [chunk.index for chunk in on_nvme] == list(range(count - NVME_CHUNKS, count))
        for chunk in on_nvme:
            numel, tensors = chunk.master.numel(), len(expected[chunk.index])
            path = nvme.run_dir / f"chunk{chunk.index:05d}.state"
            raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)
            assert raw.numel() * 4 == nvme_file_bytes(numel, tensors)
            stride = raw.numel() // tensors
            for k, tensor in enumerate(expected[chunk.index]):
                assert torch.equal(raw[k * stride : k * stride + numel], tensor)
            if precision == "bf16":  # the host's copy is the file's master, rounded
                assert chunk.master.dtype == torch.bfloat16
                assert torch.equal(chunk.master, expected[chunk.index][0].to(torch.bfloat16))
            for slot_tensor in chunk.training.optimizer.states:  # the slot: updated, then reused
                assert not nvme.holds_tensor(chunk.master) and nvme.holds_tensor(slot_tensor)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoints_resume_onto_another_n_optimizer(tmp_path: Path, precision: str) -> None:
    """Saved from the files at update 3 (in bf16 the masters too), resumed with the state in
    memory and with two NVMe chunks: both end as the uninterrupted in-memory run does."""
    memory = {"ssd": {"path": str(tmp_path / "nvme")}}

    def spec(root: str, n_optimizer: int | None = None, **overrides: Any) -> dict[str, Any]:
        ssd = {**memory["ssd"], **({} if n_optimizer is None else {"n_optimizer": n_optimizer})}
        return checkpoint_job(root, memory={"ssd": ssd}, precision=precision, **overrides)

    plain = train_until(spec(str(tmp_path / "plain")), until=5)
    first = train_until(spec(str(tmp_path / "a"), 4, checkpoint={"interval_steps": 3}), until=3)
    assert first["losses"] == plain["losses"][:3]
    for n_optimizer in (0, 2):
        second = train_until(spec(str(tmp_path / "a"), n_optimizer), until=5)
        assert second["started_at"] == 3
        assert first["losses"] + second["losses"] == plain["losses"]
        assert_state_equal(second["state"], plain["state"])
    assert [entry.name for entry in (tmp_path / "nvme").iterdir()] == []


def switched(root: Path, precision: str, before: int, after: int) -> dict[str, torch.Tensor]:
    """Two updates at 64 KiB chunks (``before`` NVMe ones), switched to twice the chunk size,
    all offloaded (``after`` NVMe ones), two more updates: the final state."""
    import dataclasses

    from protrain.runtime.chunks.layout import layout_from_params

    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    engine = runtime.initialize(tiny_gpt(0), config=job(root, n_optimizer=before, precision=precision))
    with engine:
        train_updates(engine, data, range(2))
        numel = 2 * engine.chunks.layout.chunk_numel
        layout = layout_from_params(tuple(engine.chunks.layout.params), chunk_numel=numel, world_size=1)
        size = numel * (4 if precision == "fp32" else 2)
        plan = dataclasses.replace(
            engine.plan, chunk_size=size, num_chunks=layout.num_chunks, n_persist=0, n_optimizer=after
        )
        engine.switch_plan(plan)
        nvme = engine.chunks.store.tiers.nvme
        assert sum(chunk.state_on_nvme for chunk in engine.chunks.chunks) == after
        if nvme is not None:
            assert len(list(nvme.run_dir.iterdir())) == after, "the old layout's files went"
        train_updates(engine, data, range(2, STEPS))
        return engine.state_dict()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_plan_switch_moves_the_state_through_the_files(tmp_path: Path, precision: str) -> None:
    """From four NVMe chunks of 64 KiB to two of twice the size: training goes on exactly as
    torch's fused AdamW (fp32), as the same switch with the state in memory (bf16)."""
    state = switched(tmp_path / "nvme", precision, NVME_CHUNKS, 2)
    if precision == "fp32":
        data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
        expected, _ = train_reference(tiny_gpt(0), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    else:
        expected = switched(tmp_path / "ram", precision, 0, 0)
    assert_state_equal(state, expected)


def test_a_full_disk_is_refused_before_training(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "256k") as disk:
        spec = job(tmp_path, n_optimizer=NVME_CHUNKS)
        spec["memory"]["ssd"]["path"] = str(disk)
        with pytest.raises(SpecError, match=r"memory\.ssd\.path: .*not enough free space for optimizer state files"):
            runtime.initialize(tiny_gpt(0), config=spec)
        assert list(disk.iterdir()) == [], "nothing left behind"


def test_a_disk_without_room_for_the_checkpoints_beside_is_refused_before_training(tmp_path: Path) -> None:
    """The state files fit the disk, but not with the checkpoints kept on the same filesystem:
    refused at start, naming both, and nothing is left there."""
    with small_tmpfs(tmp_path / "small", "2m") as disk:
        spec = job(tmp_path, n_optimizer=NVME_CHUNKS)
        spec["memory"]["ssd"]["path"] = str(disk / "nvme")
        with runtime.initialize(tiny_gpt(0), config=spec):  # the files alone fit
            pass
        spec["checkpoint"] = {"dir": str(disk / "ckpt"), "keep_last": 2}
        with pytest.raises(SpecError, match=r"checkpoints in .*ckpt \(3 of this rank's share\) beside the optimizer"):
            runtime.initialize(tiny_gpt(0), config=spec)
        assert list((disk / "nvme").iterdir()) == [], "nothing left behind"


def test_a_file_cut_short_fails_naming_it(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with runtime.initialize(tiny_gpt(0), config=job(tmp_path, n_optimizer=NVME_CHUNKS)) as engine:
        train_updates(engine, data, range(1))
        nvme = engine.chunks.store.tiers.nvme
        nvme.drain()
        victim = nvme.run_dir / "chunk00011.state"  # shares a slot: read again next update
        os.truncate(victim, 0)
        with pytest.raises((SsdIoError, RuntimeError)) as caught:
            train_updates(engine, data, range(1, 2))
        error = caught.value if isinstance(caught.value, SsdIoError) else caught.value.__cause__
        assert isinstance(error, SsdIoError) and str(victim) in str(error) and "truncated" in str(error)
    assert not nvme.run_dir.exists(), "the files went with the engine"


def test_a_gradient_file_cut_short_fails_naming_it(tmp_path: Path) -> None:
    """Mid-window (accumulation 2) a kept gradient is read back by the next micro-batch's add: a
    file cut short behind the engine's back fails there, naming it, and the files still go."""
    data = lm_batches(micro_batch_size=2, accumulation=2, world_size=1)
    spec = job(tmp_path, n_optimizer=NVME_CHUNKS, gradient_accumulation_steps=2)
    with runtime.initialize(tiny_gpt(0), config=spec) as engine:
        engine.backward(engine(**data.batch(0, 0, 0)).loss)
        engine.chunks.drain()
        nvme = engine.chunks.store.tiers.nvme
        nvme.drain()
        victim = nvme.run_dir / "chunk00011.grad"
        os.truncate(victim, 0)
        with pytest.raises((SsdIoError, RuntimeError)) as caught:
            engine.backward(engine(**data.batch(0, 1, 0)).loss)
            engine.step()
        error = caught.value if isinstance(caught.value, SsdIoError) else caught.value.__cause__
        assert isinstance(error, SsdIoError) and str(victim) in str(error) and "truncated" in str(error)
    assert not nvme.run_dir.exists(), "the files went with the engine"


def test_spec_needs_a_path() -> None:
    from protrain.runtime.config.spec_io import validate_spec

    with pytest.raises(SpecError, match=r"ssd\.n_optimizer=2 needs ssd\.path"):
        validate_spec({"memory": {"ssd": {"n_optimizer": 2}}}, source="job.yaml")


ENGINE_THEN_WAIT = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
from protrain import runtime
from tests.helpers import lm_batches, tiny_gpt, train_updates
from tests.unit.test_nvme_optimizer_state import job
engine = runtime.initialize(tiny_gpt(0), config=job(Path({tmp!r}), n_optimizer=2))
print(engine.chunks.store.tiers.nvme.run_dir, flush=True)
data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
while True:
    train_updates(engine, data, range(2))
"""


def test_ctrl_c_leaves_no_file(tmp_path: Path) -> None:
    """Ctrl-C while training: the engine stops at the update's end and its files go."""
    root = Path(__file__).resolve().parents[2]
    script = ENGINE_THEN_WAIT.format(root=str(root), tmp=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        while line and RUN_DIR_PREFIX not in line:
            line = child.stdout.readline()
        run_dir = Path(line.strip())
        assert run_dir.exists()
        child.send_signal(signal.SIGINT)
        child.wait(timeout=60)
    finally:
        child.kill()
    assert not run_dir.exists()


def test_a_crashed_runs_files_go_with_the_next_engine_on_the_path(tmp_path: Path) -> None:
    """A process killed outright (SIGKILL, the OOM killer) leaves its folder: the next engine on
    the same path removes it, its process being gone."""
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    stale = tmp_path / "nvme" / f"{RUN_DIR_PREFIX}{socket.gethostname()}-{dead_pid.pid}-rank0"
    stale.mkdir(parents=True)
    (stale / "chunk00011.state").write_bytes(b"\0" * 4096)
    with runtime.initialize(tiny_gpt(0), config=job(tmp_path, n_optimizer=2)) as engine:
        assert not stale.exists() and engine.chunks.store.tiers.nvme.run_dir.exists()


def test_auto_moves_state_to_nvme_only_when_host_memory_binds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``n_optimizer: auto`` with a path: none while the state fits host memory; with a budget
    256 KiB short, the fewest chunks that free that much (each moved chunk frees its moments,
    the first three bring a host slot of a whole shard's each), training exactly as before."""
    from protrain.runtime.planning.planner import Planner

    # What the process holds beside the plan is whatever this test process holds: made a
    # constant, so that the budget below binds by the plan's own bytes.
    monkeypatch.setattr(Planner, "host_fixed_bytes", property(lambda self: 0))
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    example = data.batch(0, 0, 0)

    def auto(root: Path, host_budget: str = "auto", n_buffer: int | str = "auto") -> dict[str, Any]:
        spec = job(root, n_optimizer=NVME_CHUNKS)
        spec["memory"].update(host_budget=host_budget, n_buffer=n_buffer, n_swap=0, n_checkpoint=0)
        spec["memory"]["ssd"] = {"path": str(root / "nvme"), "n_offload": 0}  # n_optimizer: auto
        with runtime.initialize(tiny_gpt(0), config=spec, example_batch=example) as engine:
            plan = engine.plan
            offloaded = [(info.used, info.trainable) for info in engine.chunks.layout.chunks[plan.n_persist :]]
            train_updates(engine, data, range(STEPS))
            return {"plan": plan, "state": engine.state_dict(), "offloaded": offloaded}

    roomy = auto(tmp_path / "roomy")
    assert roomy["plan"].n_optimizer == 0 and "memory.ssd.n_optimizer" in roomy["plan"].chosen
    needed = roomy["plan"].predicted_peak_host_bytes
    tight = auto(tmp_path / "tight", host_budget=str(needed - (256 << 10)))
    moved = tight["plan"].n_optimizer
    assert tight["plan"].predicted_peak_host_bytes <= needed - (256 << 10)

    def freed(n_nvme: int) -> int:
        regions = [
            offloaded_region_bytes(tight["offloaded"], 16 << 10, element_size=4, keeps_gradients=False, n_nvme=n)
            for n in (0, n_nvme)
        ]
        return regions[0] - regions[1]

    assert freed(moved) >= 256 << 10 > freed(moved - 1), "the fewest chunks that free enough"
    on_nvme = tight["offloaded"][-moved:]
    assert tight["plan"].predicted_nvme_bytes == sum(nvme_file_bytes(used, 2) for used, _ in on_nvme)
    assert_state_equal(tight["state"], roomy["state"])
    # Every other knob set by hand: no search, the rule's plan gets the fewest NVMe chunks that
    # fit, counted as the search counts them.
    by_hand = auto(tmp_path / "by-hand", host_budget=str(needed - (256 << 10)), n_buffer=tight["plan"].n_buffer)
    assert by_hand["plan"].predicted_peak_host_bytes is None
    assert by_hand["plan"].n_optimizer == moved
    assert_state_equal(by_hand["state"], roomy["state"])

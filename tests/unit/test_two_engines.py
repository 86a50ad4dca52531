"""Two engines alive in one process (a teacher and a student, an actor and a critic): both train
interleaved, each like plain PyTorch; closing one leaves the other working; neither reseeds or
disturbs the other's random streams; they cannot both claim the whole device or one checkpoint
directory; after both close, threads, open files, signal handlers and activation directories
are back to where they were."""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.planning.profilers import Profilers
from protrain.runtime.training.stop import TrainingStopped
from tests.helpers import TINY_GPT, assert_state_equal, lm_batches, tiny_gpt, train_reference, train_updates

LR = 1e-3


def job(tmp_path: Path, *, device_budget: str | int = "256MiB", **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": LR, "weight_decay": 0.1},
        "output_dir": str(tmp_path / "runs"),
        "memory": {"device_budget": device_budget},
    }
    spec.update(overrides)
    return spec


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _protrain_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("protrain"))


def test_teacher_and_student_train_interleaved_each_like_plain_pytorch(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected_teacher, _ = train_reference(tiny_gpt(0), data, steps=3, lr=LR, weight_decay=0.1)
    expected_student, _ = train_reference(tiny_gpt(1), data, steps=6, lr=LR, weight_decay=0.1)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    threads, fds, sigint = _protrain_threads(), _open_fds(), signal.getsignal(signal.SIGINT)

    # Both put a block's activations under the same ssd.path; the student also offloads every
    # chunk through two buffers, so both engines run side-stream work and files at once.
    teacher = runtime.initialize(
        tiny_gpt(0),
        config=job(tmp_path, memory={"device_budget": "256MiB", "ssd": {"path": str(ssd)}, "block_modes": ["ssd", "keep"]}),
    )
    student = runtime.initialize(
        tiny_gpt(1),
        config=job(
            tmp_path,
            memory={
                "device_budget": "256MiB",
                "chunk_size": "64KiB",
                "n_persist": 0,
                "n_buffer": 2,
                "ssd": {"path": str(ssd)},
                "block_modes": ["checkpoint", "ssd"],
            },
        ),
    )
    for update in range(3):
        train_updates(teacher, data, range(update, update + 1))
        train_updates(student, data, range(update, update + 1))
    teacher_state = teacher.state_dict()
    teacher.close()
    # The student goes on alone: its process group, side streams, files and signals still work.
    train_updates(student, data, range(3, 6))
    student_state = student.state_dict()
    student.close()

    assert_state_equal(teacher_state, expected_teacher)
    assert_state_equal(student_state, expected_student)
    assert list(ssd.iterdir()) == [], "activation directories left behind"
    assert _protrain_threads() == threads
    assert _open_fds() == fds
    assert signal.getsignal(signal.SIGINT) is sigint


def test_second_initialize_leaves_the_random_streams_as_they_were(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    first = runtime.initialize(tiny_gpt(0), config=job(tmp_path))
    try:
        # With dropout, any forward draws from the stream. tiny_gpt seeds the stream itself, as
        # building a model in a script may.
        student = tiny_gpt(1, dataclasses.replace(TINY_GPT, dropout=0.1))
        torch.rand(3)  # the stream has moved on since
        before = torch.get_rng_state()
        # An example batch makes the second engine record first-use order and profile: both run
        # forwards, which must not draw from (or reseed) the stream the first engine uses.
        second = runtime.initialize(student, config=job(tmp_path), example_batch=data.batch(0, 0, 0))
        second.close()
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        first.close()


def test_a_second_auto_budget_is_what_the_first_engines_plan_left(
    tmp_path: Path,
) -> None:
    """A notebook cell run again, two Trainers in one script: the second auto engine gets the
    device less what the first one's plan holds (its predicted peak with the search's margin),
    not a refusal."""
    capacity = 64 * 2**20
    device = Profilers(device_capacity=lambda info, ranks: capacity)  # the device's free memory
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    first = runtime.initialize(tiny_gpt(0), profilers=device, config=job(tmp_path, device_budget="auto"), example_batch=data.batch(0, 0, 0))
    try:
        peak = first.plan.predicted_peak_device_bytes
        assert peak is not None and first.plan.device_budget_bytes == capacity
        second = runtime.initialize(tiny_gpt(1), profilers=device, config=job(tmp_path, device_budget="auto"))
        assert second.plan.device_budget_bytes == capacity - int(peak * 1.05)
        train_updates(second, data, range(1))
        second.close()
    finally:
        first.close()
    # The closed engines gave everything back: the whole capacity again.
    with runtime.initialize(tiny_gpt(1), profilers=device, config=job(tmp_path, device_budget="auto")) as third:
        assert third.plan.device_budget_bytes == capacity


def test_an_auto_budget_with_nothing_left_names_each_live_engine_and_how_to_free_it(
    tmp_path: Path,
) -> None:
    device = Profilers(device_capacity=lambda info, ranks: 64 * 2**20)  # the device's free memory
    first = runtime.initialize(tiny_gpt(0), profilers=device, config=job(tmp_path, device_budget="64MiB"))
    try:
        with pytest.raises(SpecError) as refused:
            runtime.initialize(tiny_gpt(1), profilers=device, config=job(tmp_path, device_budget="auto"))
        message = str(refused.value)
        line = first._state.claim.created_at
        assert line.startswith(__file__ + ":"), line
        assert f"engine {first._state.claim.label} (made at {line}) holds 0.06 GiB (its memory.device_budget)" in message
        assert "close it (engine.close(), trainer.end()) or drop every reference to it" in message
    finally:
        first.close()
    # The refused engine claimed nothing, and the closed one gave its claim back.
    runtime.initialize(tiny_gpt(1), profilers=device, config=job(tmp_path, device_budget="auto")).close()


def test_an_auto_budget_below_every_plan_names_the_engines_holding_the_rest(
    tmp_path: Path,
) -> None:
    device = Profilers(device_capacity=lambda info, ranks: 64 * 2**20)  # the device's free memory
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with runtime.initialize(tiny_gpt(0), profilers=device, config=job(tmp_path, device_budget=64 * 2**20 - 200 * 2**10)) as first:
        with pytest.raises(SpecError) as refused:
            runtime.initialize(tiny_gpt(1), profilers=device, config=job(tmp_path, device_budget="auto"), example_batch=data.batch(0, 0, 0))
        message = str(refused.value)
        assert message.startswith("memory: no plan fits the device budget of 200.00 KiB per rank"), message
        assert f"the rest of the device is held by engine {first._state.claim.label} (made at {__file__}:" in message


def test_auto_budget_beside_a_set_one_is_what_the_set_one_left(
    tmp_path: Path,
) -> None:
    device = Profilers(device_capacity=lambda info, ranks: 1 << 30)  # the device's free memory
    first = runtime.initialize(tiny_gpt(0), profilers=device, config=job(tmp_path, device_budget="300MiB"))
    try:
        second = runtime.initialize(tiny_gpt(1), profilers=device, config=job(tmp_path, device_budget="auto"))
        assert second.plan.device_budget_bytes == (1 << 30) - 300 * 2**20
        second.close()
    finally:
        first.close()


def test_one_checkpoint_directory_for_two_engines_is_refused(tmp_path: Path) -> None:
    checkpoint = {"dir": str(tmp_path / "ckpt")}
    first = runtime.initialize(tiny_gpt(0), config=job(tmp_path, checkpoint=checkpoint))
    try:
        with pytest.raises(SpecError, match=r"checkpoint\.dir: .*ckpt is used by engine \d+ of this process"):
            runtime.initialize(tiny_gpt(1), config=job(tmp_path, checkpoint=checkpoint))
        other = runtime.initialize(tiny_gpt(1), config=job(tmp_path, checkpoint={"dir": str(tmp_path / "ckpt2")}))
        other.close()
    finally:
        first.close()


def test_closing_one_engine_leaves_ctrl_c_stopping_the_other(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    sigint = signal.getsignal(signal.SIGINT)
    first = runtime.initialize(tiny_gpt(0), config=job(tmp_path))
    second = runtime.initialize(tiny_gpt(1), config=job(tmp_path))
    first.close()
    os.kill(os.getpid(), signal.SIGINT)  # handled by the stop handler: no KeyboardInterrupt
    out = second(**data.batch(0, 0, 0))
    second.backward(out.loss)
    with pytest.raises(TrainingStopped) as stopped:
        second.step()
    assert stopped.value.code == 130
    second.close()
    assert signal.getsignal(signal.SIGINT) is sigint


def test_a_second_engine_on_a_terminal_prints_named_lines_instead_of_a_second_bar() -> None:
    from rich.console import Console

    from protrain.runtime.observability.console import ProgressReporter, StepRecord

    first = ProgressReporter(total_steps=4, enabled=True)
    second = ProgressReporter(total_steps=4, enabled=True, name="engine 2")
    screens = []
    for reporter in (first, second):
        screen = io.StringIO()
        reporter.console = Console(file=screen, force_terminal=True, width=120, highlight=False)
        screens.append(screen)
    try:
        for step in (1, 2):
            record = StepRecord(
                step=step, loss=1.0, lr=1e-3, grad_norm=None, step_time_s=0.1, tokens_per_s=10.0, skipped=False, loss_scale=None
            )
            first.update(record)
            second.update(record)
    finally:
        first.close()
        second.close()
    assert first._progress is None and "engine 2" not in screens[0].getvalue()
    lines = [line for line in screens[1].getvalue().splitlines() if line.strip()]
    assert lines and all(line.startswith("engine 2: step ") for line in lines), lines


def test_an_output_dir_that_is_a_file_is_refused_by_name_without_the_launcher(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("")
    threads = _protrain_threads()
    with pytest.raises(SpecError, match=r"output_dir: .*taken cannot hold run folders"):
        runtime.initialize(tiny_gpt(0), config=job(tmp_path, output_dir=str(tmp_path / "taken")))
    assert _protrain_threads() == threads, "the refused engine started no workers"
    # Nothing was left claimed by the refused engine: a second try with a good folder works.
    runtime.initialize(tiny_gpt(0), config=job(tmp_path, device_budget="auto")).close()

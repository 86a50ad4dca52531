"""What the speed sections (overlap, cost_model, capacity) share: engines built quietly, models
built on the meta device and filled chunk by chunk, the device's peak memory over a span of steps,
the waits an engine reports, and memory handed back between engines."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

SEED = 1234
GIB = 1 << 30


def quiet_initialize(model: nn.Module, spec: dict[str, Any], **kwargs: Any) -> Any:
    """``runtime.initialize`` with its plan table and progress lines kept off the report's
    output (the engine's console binds stdout when it is built)."""
    from protrain import runtime

    with contextlib.redirect_stdout(io.StringIO()):
        return runtime.initialize(model, config=spec, **kwargs)


def meta_model(build: Callable[[], nn.Module]) -> tuple[nn.Module, Any]:
    """``build()`` on the meta device, and the weights source that gives each parameter its
    constructor's initial value as the engine fills its chunk (``runtime.model_io.weights.ModelInit``):
    the model never exists whole in host memory, let alone twice (DESIGN section 4)."""
    from accelerate import init_empty_weights

    from protrain.runtime.model_io.weights import ModelInit

    with init_empty_weights():
        model = build()
    return model, ModelInit(model, seed=SEED)


def free_memory(device: torch.device) -> None:
    """Collect garbage and hand freed memory back (heap pages; CUDA's cached blocks), so that
    the next engine starts from a quiet device."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def allocated_bytes(device: torch.device) -> int:
    """The device tier's bytes now: CUDA's allocator, or the C heap on CPU."""
    from protrain.runtime.hw.device import DeviceInfo, device_allocated_bytes

    return device_allocated_bytes(DeviceInfo(device, "nccl" if device.type == "cuda" else "gloo"))


@contextlib.contextmanager
def device_peak(device: torch.device, model: nn.Module) -> Iterator[Callable[[], int]]:
    """The highest device allocation while the block runs (read the result after it), through
    the runtime's one memory counter (``runtime.hw.memory_counter``): on CUDA the allocator's
    ``max_memory_allocated``, which the engine's own plan check reads and resets at its hooks,
    so only a ``PeakWindow`` sees every peak; read at every module's forward and every
    gradient, as the engine reads it, and once more at the end (the optimizer step). On CPU
    the C heap at the same hooks."""
    from protrain.runtime.hw.device import DeviceInfo
    from protrain.runtime.hw.memory_counter import PeakWindow, device_peak_since_last_sample, sample_at_hooks

    info = DeviceInfo(device, "nccl" if device.type == "cuda" else "gloo")
    window = PeakWindow(info)

    def sample() -> None:  # returns nothing: a forward hook's return value replaces the output
        device_peak_since_last_sample(info)

    handles = sample_at_hooks(model, after_forward=sample, after_gradient=lambda _: sample())
    highest: list[int] = []
    window.open()
    try:
        yield lambda: highest[0]
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        highest.append(window.close())
        for handle in handles:
            handle.remove()


def update_records(output_dir: Path) -> list[dict[str, Any]]:
    """The per-update records an engine wrote under ``output_dir`` (its metrics.jsonl; one
    engine per directory): loss, step time, the exposed pipeline waits."""
    paths = sorted(output_dir.glob("*/metrics.jsonl"))
    if len(paths) != 1:
        raise RuntimeError(f"expected one engine's metrics.jsonl under {output_dir}, found {len(paths)}")
    lines = paths[0].read_text().splitlines()
    return [record for record in map(json.loads, lines) if "step" in record and "waits" in record]


@contextlib.contextmanager
def where_time_goes(label: str, every_s: float = 0.25, top: int = 12) -> Iterator[None]:
    """Sample the calling thread's stack every ``every_s`` while the block runs, then print where
    it was: the innermost function, and the innermost of ProTrain's own (a breakdown of a long
    call: initialize on a 1B model took 58 s on the first GPU run) at almost no cost to it. The
    sampler holds the caller's frames for a moment, and with them their tensors: under a device
    wall measured to the byte (the CPU rehearsal) that can count, so use it where the budget is
    not that tight."""
    import collections
    import sys
    import threading

    target = threading.get_ident()
    leaves: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    samples = [0]
    done = threading.Event()

    def place(frame: Any) -> str:
        code = frame.f_code
        return f"{'/'.join(code.co_filename.rsplit('/', 2)[-2:])}:{code.co_name}:{frame.f_lineno}"

    def sample() -> None:
        while not done.wait(every_s):
            frame = sys._current_frames().get(target)
            if frame is None:
                continue
            samples[0] += 1
            leaves[place(frame)] += 1
            while frame is not None and not str(frame.f_globals.get("__name__", "")).startswith("protrain."):
                frame = frame.f_back
            ours[place(frame) if frame is not None else "(outside ProTrain)"] += 1

    sampler = threading.Thread(target=sample, name="where-time-goes", daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        total = max(1, samples[0])
        lines = [f"{label}: where the time went ({samples[0]} samples every {every_s} s)"]
        for title, counts in (("innermost ProTrain frame", ours), ("innermost frame", leaves)):
            lines.append(f"  by {title}:")
            lines += [f"    {100 * n / total:5.1f}%  {where}" for where, n in counts.most_common(top)]
        print("\n".join(lines), flush=True)

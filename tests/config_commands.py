"""What the shipped-config tests share: a spec header's ``protrain-run`` commands, the same
command at a tiny preset with CPU stand-ins, and the check that such a run trained through
chunks of a model built on the meta device (in-process in tests/unit, launched in tests/e2e)."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

from protrain.runtime.config.spec_io import load_spec

TINY_FLAGS = {"--preset": "tiny", "--seq-len": "32", "--steps": "2", "--init": "chunks"}
"""The header's script flags with the model swapped for the tiny preset of the same --arch,
a few updates, and the meta-device build the large presets take (forced: tiny is small)."""
DEVICE_BUDGET = "8MiB"
"""A budget the tiny presets fit with every chunk streamed, with room to spare (feasibility
must not turn on a few KiB of measured memory)."""
STREAMED = "memory.n_persist=0"
"""Every chunk lives in host memory and is streamed through the device buffers. Left to the
planner, whether some chunks stay on the device at a budget this small turns on a few KiB of
measured memory and on how the cost model weighs recompute against streaming on a loaded
machine: the test would check that tie, not that the header command trains through chunks."""
MAX_ACCUMULATION = 2
"""Micro-batches per update on CPU (the 70B spec's 16 would make each update 16 forwards)."""


def header_commands(path: Path) -> list[list[str]]:
    """The ``protrain-run`` command lines of a spec's header comment, split, program dropped."""
    lines = [line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    return [shlex.split(line)[1:] for line in lines if line.startswith("protrain-run ")]


def tiny_command(path: Path, scratch: Path, *extra_sets: str) -> list[str]:
    """The spec's first header command with TINY_FLAGS replacing (or added to) the script's
    flags, and ``--set`` overrides from ``cpu_overrides``."""
    argv = header_commands(path)[0]
    swapped: list[str] = []
    index = 0
    while index < len(argv):
        if argv[index] in TINY_FLAGS:
            index += 2
            continue
        swapped.append(argv[index])
        index += 1
    for flag, value in TINY_FLAGS.items():
        swapped += [flag, value]
    for override in [*cpu_overrides(path, scratch), *extra_sets]:
        swapped += ["--set", override]
    return swapped


def cpu_overrides(path: Path, scratch: Path) -> list[str]:
    """CPU stand-ins where the spec names GPU-host paths or sizes; everything else is kept."""
    spec = load_spec(path)
    overrides = [
        f"output_dir={scratch / 'runs'}",
        f"memory.device_budget={DEVICE_BUDGET}",
        f"gradient_accumulation_steps={min(spec.gradient_accumulation_steps, MAX_ACCUMULATION)}",
        STREAMED,
    ]
    if spec.memory.ssd.path is not None:
        overrides.append(f"memory.ssd.path={scratch / 'ssd'}")
    if spec.checkpoint.dir is not None:
        overrides.append(f"checkpoint.dir={scratch / 'checkpoints'}")
    return overrides


def assert_trained_through_chunks(stdout: str, metrics: Path) -> None:
    """The run built its model on the meta device, offloaded chunks, and made TINY_FLAGS'
    updates with finite losses."""
    out = " ".join(stdout.split())  # the console wraps long lines
    assert "built on the meta device and filled chunk by chunk" in out, stdout
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    plans = [event["plan"] for event in events if event.get("event") == "plan"]
    assert plans and plans[-1]["n_persist"] < plans[-1]["num_chunks"], "some chunks live in host memory"
    losses = [event["loss"] for event in events if "step" in event and "loss" in event]
    assert len(losses) == int(TINY_FLAGS["--steps"]) and all(math.isfinite(loss) for loss in losses), losses

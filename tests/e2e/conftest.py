"""Helpers for real protrain-run launches: each test gets its own working directory, spec and
scripts; ports come from the OS (master_port 0) and shutdown grace is short."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BASE_SPEC = """\
seed: 1
micro_batch_size: 2
optimizer: {lr: 1.0e-3}
scheduler: {type: constant, total_steps: 3}
launcher: {master_port: 0, shutdown_grace_s: 5, dist_timeout_s: 60}
output_dir: runs
"""

# A script that trains the tiny GPT; behaviour switches come from its own arguments.
TRAIN_SCRIPT = """\
import os, sys, time
from pathlib import Path
import torch
from protrain import runtime
from protrain_demo.corpus import LMBatches, stdlib_text_corpus
from protrain_demo.gpt import GPT, PRESETS

mode = sys.argv[1] if len(sys.argv) > 1 else "train"
spec = runtime.current_spec()
torch.manual_seed(spec.seed)
model = GPT(PRESETS["tiny"])
engine = runtime.initialize(model)
rank = engine.rank
Path(f"rank{rank}.pid").write_text(str(os.getpid()))
data = LMBatches(tokens=stdlib_text_corpus(), seq_len=32, micro_batch_size=2, gradient_accumulation_steps=1,
                 world_size=engine.world_size, seed=1)
update = 0
while True:
    if mode == "fail" and rank == 1 and update == 1:
        raise RuntimeError("rank one fails on purpose")
    out = engine(**data.batch(update, 0, rank))
    engine.backward(out.loss)
    engine.step()
    Path(f"rank{rank}.loss").write_text(repr(float(out.loss)))
    update += 1
    if mode == "train" and update == 3:
        break
    if mode in ("forever", "fail"):
        Path(f"rank{rank}.ready").write_text("1")
        time.sleep(0.05)
Path(f"rank{rank}.done").write_text(f"{engine.rank} {engine.world_size} {engine.global_step}")
engine.close()
"""


class Job:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.spec = workdir / "job.yaml"
        self.spec.write_text(BASE_SPEC)
        self.script = workdir / "train.py"
        self.script.write_text(TRAIN_SCRIPT)

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "protrain.launcher", *args]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args),
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=clean_env(),
        )

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """``env``: variables added to the clean environment."""
        return subprocess.Popen(
            self.command(*args),
            cwd=self.workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**clean_env(), **(env or {})},
        )


def clean_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RANK", "WORLD_SIZE", "MASTER_", "SLURM_"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "scripts")])  # scripts/: the demo's model
    return env


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def job(tmp_path: Path) -> Job:
    return Job(tmp_path)

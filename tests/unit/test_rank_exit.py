"""How a rank ends while the engine's worker threads are still busy with torch work: with the
exit code a stop or a failure asks for, never an abort from the interpreter's teardown
("terminate called without an active exception", which Ctrl-C during startup met in CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """\
import sys, time
import torch
from protrain.runtime.hw.device import _OrderedWorker
from protrain.runtime.training.stop import TrainingStopped

def busy() -> None:  # a long job: the worker is inside torch when the rank ends
    x = torch.randn(128, 128)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        x = torch.tanh(x @ x)

workers = [_OrderedWorker(f"worker{i}", kind="host", threads=1) for i in range(4)]
for worker in workers:
    worker.submit(busy)
time.sleep(0.3)
end = sys.argv[1]
if end == "ctrl-c":
    raise KeyboardInterrupt
if end == "stopped":
    raise TrainingStopped(130)
if end == "error":
    raise RuntimeError("the script fails on purpose")
"""

ENDS = {"ctrl-c": 130, "stopped": 130, "error": 1, "done": 0}


@pytest.mark.timeout(120)
def test_a_rank_ends_with_its_code_while_worker_threads_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    runs = {
        end: subprocess.Popen(
            [sys.executable, "-m", "protrain.launcher.rank_entry", str(script), end],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for end in ENDS
    }
    for end, proc in runs.items():
        _, stderr = proc.communicate(timeout=100)
        assert proc.returncode == ENDS[end], f"{end}: exit {proc.returncode}\n{stderr}"
        assert "terminate called" not in stderr, f"{end}: {stderr}"
        if end == "error":
            assert "RuntimeError: the script fails on purpose" in stderr and "Traceback" in stderr
        else:
            assert "Traceback" not in stderr, f"{end}: {stderr}"

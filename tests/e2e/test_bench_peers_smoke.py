"""scripts/bench_peers.py --smoke: one tiny step of every peer on 2 gloo ranks, exit code 0 and the
table printed, so the benchmark cannot rot. Peers that are not installed (DeepSpeed) show as rows
saying so; they are never test dependencies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository


@pytest.mark.timeout(90)
def test_bench_peers_smoke() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert result.returncode == 0, f"bench_peers.py --smoke failed:\n{result.stdout}\n{result.stderr}"
    lines = result.stdout.splitlines()
    assert any(
        line.startswith("candidate") and "s/step" in line and "vs DDP" in line and "vs FSDP2" in line
        for line in lines
    ), result.stdout
    for row in ("DDP", "FSDP2", "DeepSpeed ZeRO-3", "ProTrain n_persist=0"):
        assert any(line.startswith(row) for line in lines), f"no {row} row:\n{result.stdout}"
    assert any(line.startswith("ProTrain") and "(min)" in line for line in lines)
    assert "CPU figures" in result.stdout

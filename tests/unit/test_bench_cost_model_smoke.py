"""scripts/bench_cost_model.py --smoke: tiny models, one plan each, one step; exit code 0 and the
table and summary printed, so the benchmark cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_bench_cost_model_smoke() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_cost_model.py"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, f"bench_cost_model.py --smoke failed:\n{result.stdout}\n{result.stderr}"
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("plan") and "pred s" in line)
    for column in ("meas s", "err %", "CV %", "pred MiB", "meas MiB"):
        assert column in header
    assert sum(line.startswith("GPT ") for line in lines) >= 2 * 3  # one plan per model, three tables
    for prefix in (
        "step time: mean |error|",
        "peak device memory: mean |error|",
        "step time by phase",
        "run-to-run noise",
        "search time:",
        "profiling GPT",
    ):
        assert any(line.startswith(prefix) for line in lines), f"no line starts with {prefix!r}"
    summary = [line for line in lines if line.startswith(("step time:", "peak device memory:"))]
    assert all(line.endswith((": met", ": NOT met")) for line in summary)
    assert "plans evaluated" in result.stdout

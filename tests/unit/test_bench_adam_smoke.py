"""scripts/bench_adam.py --smoke: one step of every candidate on 1M parameters, table printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_adam_smoke() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_adam.py"), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("optimizer") and "s/step" in line and "BW share" in line for line in lines)
    for name in ("ours (ShardAdamW)", "torch AdamW(foreach=True)", "torch AdamW(fused=True)"):
        rows = [line for line in lines if line.startswith(name)]
        assert len(rows) == 2, f"{name}: expected an fp32 and a copy-out row in\n{result.stdout}"
    assert "DeepSpeedCPUAdam" in result.stdout  # a row pair, or why there is none

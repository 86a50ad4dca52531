"""scripts/bench_adam.py --smoke: one step of every candidate on 1M parameters, table printed."""

from __future__ import annotations

from tests.helpers import run_script_smoke


def test_bench_adam_smoke() -> None:
    stdout = run_script_smoke("bench_adam.py", timeout=120)
    lines = stdout.splitlines()
    assert any(line.startswith("optimizer") and "s/step" in line and "BW share" in line for line in lines)
    for name in ("ours (ShardAdamW)", "torch AdamW(foreach=True)", "torch AdamW(fused=True)"):
        rows = [line for line in lines if line.startswith(name)]
        assert len(rows) == 2, f"{name}: expected an fp32 and a copy-out row in\n{stdout}"
    assert "DeepSpeedCPUAdam" in stdout  # a row pair, or why there is none

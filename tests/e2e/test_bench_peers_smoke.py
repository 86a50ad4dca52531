"""scripts/bench_peers.py --smoke: one tiny step of every peer on 2 gloo ranks, exit code 0 and the
table printed, so the benchmark cannot rot. Peers that are not installed (DeepSpeed) show as rows
saying so; they are never test dependencies."""

from __future__ import annotations

import pytest

from tests.helpers import run_script_smoke


@pytest.mark.timeout(90)
def test_bench_peers_smoke() -> None:
    stdout = run_script_smoke("bench_peers.py", timeout=80)
    lines = stdout.splitlines()
    assert any(
        line.startswith("candidate") and "s/step" in line and "vs DDP" in line and "vs FSDP2" in line
        for line in lines
    ), stdout
    for row in ("PyTorch alone", "DDP", "FSDP2", "DeepSpeed ZeRO-3", "ProTrain n_persist=0"):
        assert any(line.startswith(row) for line in lines), f"no {row} row:\n{stdout}"
    assert any(line.startswith("ProTrain") and "(min)" in line for line in lines)
    assert any(line.startswith("floor: with no communication") for line in lines), stdout
    # ProTrain's memory figures include its profiling: each memory run started with an empty cache.
    assert "each memory run started from an empty profile cache" in stdout
    assert "(profiled in 4 of 4 runs)" in stdout, stdout
    assert any(line.startswith("ProTrain auto: n_persist") for line in lines), stdout
    assert any(line.startswith("target (issue 29) for ProTrain auto") for line in lines), stdout
    assert "CPU figures" in stdout
    # The all-offloaded candidates take the chunk size the planner picks for n_persist=0.
    assert "as planned for n_persist=0" in stdout, stdout

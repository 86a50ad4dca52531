"""scripts/bench_overhead.py and scripts/bench_offload.py --smoke: one tiny step of each engine,
exit code 0 and the table printed, so the benchmarks cannot rot."""

from __future__ import annotations

import pytest

from tests.helpers import run_script_smoke as run_smoke


@pytest.mark.timeout(90)
def test_bench_overhead_smoke() -> None:
    lines = run_smoke("bench_overhead.py").splitlines()
    assert any(line.startswith("candidate") and "s/step" in line and "ratio" in line for line in lines)
    assert any(line.startswith("plain PyTorch") for line in lines)
    assert any(line.startswith("ProTrain (all") for line in lines)
    assert any(line.startswith("ours/plain:") for line in lines)


@pytest.mark.timeout(90)
def test_bench_offload_smoke() -> None:
    lines = run_smoke("bench_offload.py").splitlines()
    assert any(
        line.startswith("engine") and "s/step" in line and "transfer wait" in line and "optimizer" in line
        for line in lines
    )
    assert any(line.startswith("all persistent") for line in lines)
    assert any(line.startswith("offload, n_buffer=") and "(minimum)" in line for line in lines)
    assert "CPU figures" in "\n".join(lines)

"""scripts/bench_cost_model.py --smoke: tiny models, one plan each, one step; exit code 0 and the
table and summary printed, so the benchmark cannot rot."""

from __future__ import annotations

import pytest

from tests.helpers import run_script_smoke


@pytest.mark.timeout(120)
def test_bench_cost_model_smoke() -> None:
    stdout = run_script_smoke("bench_cost_model.py", timeout=90)
    lines = stdout.splitlines()
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
    assert "plans evaluated" in stdout

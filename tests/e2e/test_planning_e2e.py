"""The planner as a user meets it through protrain-run: "auto" knobs filled by the search with
predictions, hand-set knobs kept, and the measured step time beside the predicted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.e2e.conftest import ROOT, Job


def run_demo(job: Job, *sets: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two ranks train the demo model for 8 steps; the plan and the plan check from metrics."""
    overrides = [arg for value in sets for arg in ("--set", value)]
    result = job.run(
        "--nproc-per-node",
        "2",
        str(ROOT / "scripts" / "train_lm.py"),
        "--steps",
        "8",
        "--config",
        str(ROOT / "configs" / "demo-cpu.yaml"),
        "--set",
        f"output_dir={job.workdir / 'runs'}",
        "--set",
        f"profiler.cache_dir={job.workdir / 'cache'}",
        *overrides,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert "predicted step time" in result.stdout and "plan check: measured" in result.stdout
    (metrics,) = Path(job.workdir / "runs").glob("*/metrics.jsonl")
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    plan = next(e["plan"] for e in events if e.get("event") == "plan")
    check = next(e for e in events if e.get("event") == "plan_check")
    return plan, check


def test_auto_knobs_are_searched_and_the_prediction_is_in_range(job: Job) -> None:
    plan, check = run_demo(job)
    assert plan["rule"].startswith("search: fastest of")
    assert {"memory.chunk_size", "memory.n_persist", "memory.n_buffer"} <= set(plan["chosen"])
    # Step time: the 2 ranks share 2 cores with whatever else runs, so this guards only gross
    # cost-model errors (a phase left out or counted twice is 2x); the tight figures live in
    # scripts/bench_cost_model.py. Measured predicted/measured over 11 runs on the loaded 2-core
    # machine (the distributed tests running beside them): 0.69 to 1.53; and 0.38 and 0.47 in CI
    # where the tests beside it started between its profiling and its measuring (alone the same
    # plans measured 0.82-1.02). A load that comes and goes does not land alike on a second run,
    # profiled again; a gross error does: that one must hold too.
    ratio = check["predicted_step_s"] / check["measured_step_s"]
    if not 0.5 < ratio < 2.0:
        for made in ("runs", "cache"):
            shutil.rmtree(job.workdir / made, ignore_errors=True)
        first, (_, check) = check, run_demo(job)
        ratio = check["predicted_step_s"] / check["measured_step_s"]
        assert 0.5 < ratio < 2.0, {"first": first, "again": check}
    assert 0.5 < ratio < 2.0, check
    # Peak device memory is counted in bytes, not timed: no noise. Measured +9.1% (over-predicted)
    # in all 11 runs, so 15% leaves 6 points for allocator differences between machines while a
    # memory model that drops or double-counts a sizeable term (buffers, activations) fails.
    assert abs(check["peak_error"]) <= 0.15, check


def test_hand_set_knobs_are_kept_through_the_launcher(job: Job) -> None:
    plan, _ = run_demo(
        job, "memory.n_persist=1", "memory.chunk_size=256KiB", "memory.n_swap=1", "memory.n_checkpoint=1"
    )
    assert (plan["n_persist"], plan["chunk_size"]) == (1, 256 * 1024)
    # The activation knobs reach the engine: one block swapped, one recomputed, the rest kept.
    assert (plan["n_swap"], plan["n_checkpoint"]) == (1, 1)
    assert sorted(plan["block_modes"]) == sorted(["swap", "checkpoint"] + ["keep"] * (len(plan["block_modes"]) - 2))
    assert plan["rule"].startswith("search") and plan["n_buffer"] >= 1
    assert "memory.n_persist" not in plan["chosen"] and "memory.n_buffer" in plan["chosen"]

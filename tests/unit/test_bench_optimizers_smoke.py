"""scripts/bench_optimizers.py --smoke: one step of every rule and its references, both paths."""

from __future__ import annotations

from tests.helpers import run_script_smoke


def test_bench_optimizers_smoke() -> None:
    stdout = run_script_smoke("bench_optimizers.py", timeout=120)
    lines = stdout.splitlines()
    for rule in ("adamw", "adam", "lion", "sgd+momentum", "sgd"):
        for path in ("host", "device"):
            ours = [line for line in lines if line.split()[:3] == [rule, path, "ours"]]
            assert len(ours) == 1, f"{rule} on the {path} path: no row of ours in\n{stdout}"
            theirs = [line for line in lines if line.split()[:2] == [rule, path] and line.rstrip().endswith("x")]
            assert theirs, f"{rule} on the {path} path: no reference row with a ratio in\n{stdout}"

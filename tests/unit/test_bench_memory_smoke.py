"""scripts/bench_memory.py --smoke: each part (export, LoRA, prediction) runs in its own process
on a tiny Llama and the report gives its measured figure against its bound."""

from __future__ import annotations

import pytest

from tests.helpers import run_script_smoke


@pytest.mark.timeout(240)
def test_bench_memory_smoke() -> None:
    stdout = run_script_smoke("bench_memory.py", timeout=220)
    lines = stdout.splitlines()
    verdicts = [line for line in lines if "the target" in line]
    assert [line.split(":")[0] for line in verdicts] == ["export", "lora", "predict"], stdout
    assert "state_dict() + save_file adds" in stdout
    assert "plan resident" in stdout  # the LoRA base is persistent, as the part claims
    assert "of which" in stdout and "the process at initialize" in stdout

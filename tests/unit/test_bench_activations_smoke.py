"""scripts/bench_activations.py --smoke: one tiny step of every mode, the table printed with a row
per mode, the raw disk line and the verdicts."""

from __future__ import annotations

from tests.helpers import run_script_smoke


def test_bench_activations_smoke() -> None:
    stdout = run_script_smoke("bench_activations.py", timeout=120)
    lines = stdout.splitlines()
    header = [line for line in lines if line.startswith("mode ")]
    assert header and "act peak MiB" in header[0] and "exposed I/O s" in header[0], stdout
    table = lines[lines.index(header[0]) + 2 :]
    table = table[: next(i for i, line in enumerate(table) if line.startswith("raw disk"))]
    rows = {line.split()[0]: line for line in table}
    assert set(rows) == {"keep", "swap", "checkpoint", "ssd"}, stdout
    # Same weights, same batches, same math: every mode ends with the same loss.
    losses = {row.split()[-1] for row in rows.values()}
    assert len(losses) == 1, rows
    assert "raw disk under the ssd path" in stdout
    assert "ssd " in lines[-1] and "target" in lines[-1]

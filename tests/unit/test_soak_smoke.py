"""CI's short soak: 60 updates with SSD activation files and a checkpoint every 10; the script
itself fails when open files, run-directory files, threads or RSS grow (scripts/soak.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_short_soak_grows_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "soak.py"),
            "--steps",
            "60",
            "--checkpoint-every",
            "10",
            "--sample-every",
            "10",
            "--workdir",
            str(tmp_path),
        ],  # fmt: skip
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")])},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "soak: no growth" in result.stdout
    # What a finished run leaves: the last two checkpoints and the metrics, no activation file.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "latest",
        "step-00000050",
        "step-00000060",
    ]
    assert list((tmp_path / "ssd").iterdir()) == []

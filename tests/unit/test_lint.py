"""The product code lints and is formatted: ruff (rules and settings in pyproject.toml) over
runtime/, profiler/ and protrain_launcher/. Run ``ruff format runtime profiler protrain_launcher``
and ``ruff check --fix runtime profiler protrain_launcher`` to fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["runtime", "profiler", "protrain_launcher"]


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", *PRODUCT],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_product_code_passes_ruffs_lint() -> None:
    done = ruff("check", "--output-format", "concise")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_product_code_is_formatted() -> None:
    done = ruff("format", "--check")
    assert done.returncode == 0, "not formatted (run `ruff format runtime profiler protrain_launcher`):\n" + done.stdout

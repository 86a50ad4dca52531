"""mypy over the product code, by its installed names (``protrain.runtime``, ``protrain.profiler``,
``protrain.launcher``: mypy cannot follow setuptools' editable-install finder, so it reads them
through a tree of links to the repository's folders). The errors it finds are exactly those
listed in tests/mypy_baseline.txt, which may only shrink: a new error fails, and so does a fixed
one until its line leaves the baseline.

    PROTRAIN_UPDATE_MYPY_BASELINE=1 .venv/bin/python -m pytest tests/unit/test_types.py

rewrites the baseline (for a fix; never to admit a new error).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASELINE = Path(__file__).resolve().parents[1] / "mypy_baseline.txt"
UPDATE_ENV = "PROTRAIN_UPDATE_MYPY_BASELINE"
FOLDERS = {"runtime": "runtime", "profiler": "profiler", "launcher": "protrain_launcher"}
ERROR = re.compile(r"^(?P<path>[^:]+):\d+: error: (?P<message>.*?)\s+\[(?P<code>[\w-]+)\]$")

pytestmark = pytest.mark.timeout(240)


def installed_tree(base: Path) -> Path:
    """``base/protrain`` laid out as installed, each folder a link to the repository's."""
    package = base / "protrain"
    package.mkdir(parents=True)
    (package / "__init__.py").symlink_to(ROOT / "runtime" / "protrain_root" / "__init__.py")
    for name, folder in FOLDERS.items():
        (package / name).symlink_to(ROOT / folder)
    return base


def repository_path(path: str) -> str:
    """``.../protrain/runtime/entry.py`` -> ``runtime/entry.py``."""
    parts = Path(path).parts
    index = len(parts) - 1 - parts[::-1].index("protrain")
    rest = parts[index + 1 :]
    if rest == ("__init__.py",):
        return "runtime/protrain_root/__init__.py"
    return "/".join((FOLDERS[rest[0]], *rest[1:]))


def mypy_errors(tmp_path: Path) -> Counter[str]:
    tree = installed_tree(tmp_path / "src")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "--no-pretty", "-p", "protrain"],
        cwd=tmp_path, env={**os.environ, "MYPYPATH": str(tree)}, capture_output=True, text=True, timeout=230,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 2: mypy itself failed
    errors: Counter[str] = Counter()
    for line in done.stdout.splitlines():
        match = ERROR.match(line)
        if match:  # notes and context lines are not errors
            errors[f"{repository_path(match['path'])}: [{match['code']}] {match['message']}"] += 1
    return errors


def test_mypy_finds_exactly_the_baselines_errors(tmp_path: Path) -> None:
    current = mypy_errors(tmp_path)
    if os.environ.get(UPDATE_ENV) == "1":
        BASELINE.write_text("".join(f"{line}\n" for line in sorted(current.elements())))
    baseline = Counter(line for line in BASELINE.read_text().splitlines() if line)
    new = current - baseline
    fixed = baseline - current
    assert not new, "new mypy errors (fix them; the baseline only shrinks):\n" + "\n".join(sorted(new.elements()))
    assert not fixed, (
        f"fixed, so remove from {BASELINE.relative_to(ROOT)} (or run with {UPDATE_ENV}=1):\n"
        + "\n".join(sorted(fixed.elements()))
    )

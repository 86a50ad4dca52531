"""Installed from a wheel, ProTrain is one package, ``protrain``: no top-level ``runtime``,
``profiler`` or ``protrain_launcher`` reaches site-packages, a checkout on the path does not shadow
it, and the Ctrl-C end-to-end test passes against the installed copy."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, Job, clean_env

pytestmark = pytest.mark.e2e

CTRL_C_TEST = "tests/e2e/test_faults.py::test_ctrl_c_checkpoints_every_rank_and_exits_130"


def site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return Path(subprocess.check_output([python, "-c", code], text=True).strip())


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with only the wheel installed; torch, pytest and the other dependencies come from
    this venv's site-packages through a .pth file (its .pth files, such as the editable install's
    finder, are not run from there), so nothing is downloaded."""
    base = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(base / "dist"), str(ROOT)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (base / "dist").glob("protrain-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = site_packages(python)
    (site / "dev_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return venv


def test_the_wheel_installs_one_package_named_protrain(installed: Path) -> None:
    python = installed / "bin" / "python"
    site = site_packages(python)
    ours = {"protrain", "runtime", "profiler", "protrain_launcher"} & {path.name for path in site.iterdir()}
    assert ours == {"protrain"}
    assert {p.name for p in (site / "protrain").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "launcher", "profiler", "runtime"
    }
    # From the checkout, with it on the path (as the end-to-end tests run): the installed copy is
    # imported, and the repository's folders are not importable under their own names by our code.
    code = (
        "import protrain, protrain.runtime.entry, protrain.launcher.cli, protrain.profiler.plan\n"
        "print(protrain.__file__); print(protrain.runtime.entry.__file__); print(protrain.__version__)"
    )
    env = {**clean_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")])}
    shown = subprocess.run([python, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    init, entry, version = shown.stdout.split()
    assert init.startswith(str(site)) and entry.startswith(str(site)) and version == "0.1.0"
    launcher = subprocess.run([installed / "bin" / "protrain-run", "--version"], capture_output=True, text=True)
    assert launcher.returncode == 0 and launcher.stdout.startswith("protrain-run 0.1.0 (torch ")


def test_the_ctrl_c_test_passes_against_the_installed_wheel(installed: Path) -> None:
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    env["PATH"] = f"{installed / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(
        [installed / "bin" / "python", "-m", "pytest", "-p", "no:cacheprovider", "-q", CTRL_C_TEST],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout


def test_a_users_profiler_py_and_runtime_py_beside_the_script_do_not_disturb_the_run(
    installed: Path, tmp_path: Path
) -> None:
    """The launcher puts the script's folder first on the path, as python does; a user's module
    named like one of our folders must not be imported in its place."""
    job = Job(tmp_path)
    for name in ("profiler", "runtime", "protrain_launcher"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    # Only the demo's model on the path (scripts/protrain_demo): protrain itself is the wheel's.
    env = {**clean_env(), "PYTHONPATH": str(ROOT / "scripts")}
    run = subprocess.run(
        [installed / "bin" / "protrain-run", "--nproc-per-node", "2", str(job.script), "--config", str(job.spec)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "was imported" not in run.stdout + run.stderr
    assert [(tmp_path / f"rank{rank}.done").read_text() for rank in range(2)] == ["0 2 3", "1 2 3"]

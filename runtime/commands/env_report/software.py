"""Software versions for the report: Python and the platform, this project (and its git
revision when run from a checkout), torch with the CUDA, cuDNN and NCCL it was built with, the
distributed backends, and the packages ProTrain works with.

Package versions come from their installed metadata, so a package is never imported to be
named (importing transformers takes seconds); torch is imported, lazily, for what only it knows.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

from protrain.runtime.commands.env_report.rows import Row, Status, run_probe

PACKAGES = (
    "transformers",
    "accelerate",
    "peft",
    "pydantic",
    "safetensors",
    "rich",
    "psutil",
    "PyYAML",
    "numpy",
    "nvidia-ml-py",
    "tensorboard",
    "wandb",
    "matplotlib",
    "deepspeed",
)
"""Installed-package versions worth knowing beside torch's (missing ones say so)."""
GIT_TIMEOUT_S = 5.0
PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The checkout (or site-packages folder) this package was imported from."""


def software_rows() -> list[Row]:
    python = platform.python_version()
    rows = [
        Row("python", f"{python} ({platform.python_implementation()}) at {sys.executable}", python),
        Row("platform", platform.platform()),
    ]
    rows += run_probe("protrain", _project_rows)
    rows += run_probe("torch", _torch_rows)
    rows += [_package_row(name) for name in PACKAGES]
    return rows


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_row(name: str) -> Row:
    version = package_version(name)
    return Row(name, version or "not installed", version)


def _project_rows() -> list[Row]:
    version = package_version("protrain") or "not installed (run from the source tree)"
    revision = git_revision(PROJECT_ROOT)
    text = version if revision is None else f"{version}, git {revision}"
    return [Row("protrain", f"{text} at {PROJECT_ROOT}", {"version": version, "git": revision})]


def git_revision(root: Path) -> str | None:
    """The short commit of the checkout at ``root`` with ", modified" when tracked files changed;
    None when ``root`` is no checkout or git cannot tell."""
    if not (root / ".git").exists():
        return None
    try:
        head = _git(root, "rev-parse", "--short", "HEAD")
        changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (", modified" if changed else "")


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True
    )
    return done.stdout.strip()


def _torch_rows() -> list[Row]:
    import torch  # lazily: the launcher's other paths never load it

    cuda = torch.version.cuda
    rows = [
        Row("torch", f"{torch.__version__} at {Path(torch.__file__).parent}", torch.__version__),
        Row("torch CUDA", f"built with CUDA {cuda}" if cuda else "CPU-only build (no CUDA)", cuda),
    ]
    hip = getattr(torch.version, "hip", None)
    if hip:
        rows.append(Row("torch ROCm", f"built with HIP {hip}", hip))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    rows.append(Row("cuDNN", str(cudnn) if cudnn else "not in this build", cudnn))
    rows += run_probe("NCCL", lambda: [_nccl_row()])
    backends = {
        "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        "mpi": torch.distributed.is_available() and torch.distributed.is_mpi_available(),
    }
    names = [name for name, present in backends.items() if present]
    rows.append(
        Row(
            "torch.distributed",
            ", ".join(names) if names else "not available in this build",
            names,
            Status.OK if names else Status.NOTE,
        )
    )
    return rows


def _nccl_row() -> Row:
    import torch

    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return Row("NCCL", "not in this build")
    version = torch.cuda.nccl.version()
    text = ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)
    return Row("NCCL", text, text)

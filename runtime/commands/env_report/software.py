"""What the job runs on: versions (Python, the OS, ProTrain with its git revision, torch and what it
was built with, the packages ProTrain works with, from installed metadata: importing transformers
takes seconds), the NVIDIA driver (through NVML, ``nvidia-ml-py``) and the GPUs torch sees. No GPU or
driver is a note: the usual CPU machine, not a fault."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from protrain.runtime.commands.env_report.rows import Row, Status, describe, format_bytes, note_if, run_probe

PACKAGES = ("pydantic", "transformers", "accelerate", "peft", "safetensors")
PROJECT_ROOT = Path(__file__).resolve().parents[3]  # the checkout (or site-packages/protrain)


def software_rows() -> list[Row]:
    python = platform.python_version()
    rows = [Row("python", f"{python} at {sys.executable}", python), Row("platform", platform.platform())]
    rows += run_probe("protrain", lambda: [_protrain_row()])
    rows += run_probe("torch", _torch_rows)
    return rows + [Row(name, (version := package_version(name)) or "not installed", version) for name in PACKAGES]


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _protrain_row() -> Row:
    version = package_version("protrain") or "not installed (run from the source tree)"
    revision = git_revision(PROJECT_ROOT)
    text = version if revision is None else f"{version}, git {revision}"
    return Row("protrain", f"{text} at {PROJECT_ROOT}", {"version": version, "git": revision})


def git_revision(root: Path) -> str | None:
    """The short commit ("-dirty" when tracked files changed); None outside a checkout."""
    if not (root / ".git").exists():
        return None
    command = ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=10"]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _torch_rows() -> list[Row]:
    import torch  # lazily: the launcher's other paths never load it

    hip, cuda = torch.version.hip, torch.version.cuda
    build = f"ROCm (HIP {hip})" if hip else f"CUDA {cuda}" if cuda else "CPU-only build (no CUDA)"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return [
        Row("torch", f"{torch.__version__} at {Path(torch.__file__).parent}", torch.__version__),
        Row("torch build", build, hip or cuda),
        Row("cuDNN", str(cudnn) if cudnn else "not in this build", cudnn),
        *run_probe("torch.distributed", lambda: [_distributed_row(torch)]),
    ]


def _distributed_row(torch: Any) -> Row:
    """The collective backends this build has, with NCCL's version."""
    dist = torch.distributed
    backends = ("nccl", "gloo", "mpi") if dist.is_available() else ()
    names = [name for name in backends if getattr(dist, f"is_{name}_available")()]
    text = ", ".join(names) or "not available in this build"
    if "nccl" in names:
        text += " (NCCL " + ".".join(str(part) for part in torch.cuda.nccl.version()) + ")"
    return Row("torch.distributed", text, names, note_if(not names))


def gpu_rows() -> list[Row]:
    return run_probe("NVIDIA driver", lambda: [driver_row()]) + run_probe("torch.cuda", torch_gpu_rows)


def driver_row() -> Row:
    """The driver version and the newest CUDA it serves (a torch built for a newer one finds no GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # noqa: BLE001 - no pynvml, no libnvidia-ml, no kernel module: no driver
        return Row("NVIDIA driver", f"none found ({describe(err)})", status=Status.NOTE)
    try:
        driver, cuda = pynvml.nvmlSystemGetDriverVersion(), int(pynvml.nvmlSystemGetCudaDriverVersion())
    finally:
        pynvml.nvmlShutdown()
    driver = driver.decode() if isinstance(driver, bytes) else str(driver)  # bytes in older pynvml
    return Row("NVIDIA driver", f"{driver} (CUDA {cuda // 1000}.{cuda % 1000 // 10})", driver)


def torch_gpu_rows() -> list[Row]:
    import torch  # lazily: the launcher's other paths never load it

    if torch.version.cuda is None and torch.version.hip is None:
        return [Row("devices", "none: this torch is a CPU-only build", 0)]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        why = "no driver loaded, CUDA_VISIBLE_DEVICES empty, or no GPU"
        return [Row("devices", f"none visible ({why})", 0, Status.NOTE)]
    return [Row("devices", str(count), count)] + [_device_row(index) for index in range(count)]


def _device_row(index: int) -> Row:
    import torch

    props = torch.cuda.get_device_properties(index)
    capability = f"{props.major}.{props.minor}"
    try:  # what every process holds (another job's memory is a common cause of out-of-memory)
        used: int | None = int(torch.cuda.device_memory_used(index))  # NVML or amdsmi, in torch's numbering
    except Exception:  # noqa: BLE001 - older torch, no NVML: the row goes without it
        used = None
    in_use = "" if used is None else f" ({format_bytes(used)} in use)"
    text = f"{props.name}, {format_bytes(props.total_memory)}{in_use}, compute capability {capability}"
    value = {"name": props.name, "memory_total": props.total_memory, "memory_used": used, "capability": capability}
    return Row(f"cuda:{index}", text, value)

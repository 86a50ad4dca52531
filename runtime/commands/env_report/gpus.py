"""GPUs for the report: through NVML (``pynvml``, from the ``nvidia-ml-py`` package) when it is
importable, else through torch.cuda; either way name, memory, compute capability, the PCIe link
(generation and width, now and at most: host<->device copies run at the link's rate) and the
NUMA node (pinned host buffers near the GPU's socket copy faster).

What NVML cannot say is read from sysfs (``/sys/bus/pci/devices/<bus id>``), which is also where
the torch.cuda path finds the link and the node. A machine without a GPU gets rows that say so.
NVML numbers GPUs its own way and ignores ``CUDA_VISIBLE_DEVICES``; the bus id ties them together.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from protrain.runtime.commands.env_report.rows import Row, Status, describe, format_bytes, run_probe

SYSFS_PCI = Path("/sys/bus/pci/devices")
GENERATION_BY_GT_S = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
"""PCIe generation by its per-lane transfer rate (GT/s), as sysfs gives the link speed."""


@dataclass(slots=True)
class GpuFacts:
    """What the report shows of one GPU; None where it could not be read (``problems`` says why)."""

    label: str
    name: str
    memory_total: int | None = None
    memory_used: int | None = None
    capability: str | None = None
    bus_id: str | None = None
    """sysfs form: "0000:18:00.0"."""
    link_now: tuple[int | None, int | None] = (None, None)
    """(PCIe generation, lanes) the link runs at now (the generation drops when the GPU idles)."""
    link_max: tuple[int | None, int | None] = (None, None)
    numa_node: int | None = None
    problems: list[str] = field(default_factory=list)


def gpu_rows(sysfs: Path = SYSFS_PCI) -> list[Row]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    rows = [Row("CUDA_VISIBLE_DEVICES", "unset (every GPU)" if visible is None else repr(visible), visible)]
    pynvml = _import_pynvml()
    if isinstance(pynvml, str):
        rows.append(Row("NVML", f"not used: {pynvml}; the GPUs below are torch.cuda's", status=Status.NOTE))
        nvml_rows: list[Row] = []
    else:
        nvml_rows = run_probe("NVML", lambda: nvml_gpu_rows(pynvml, sysfs))
        if len(nvml_rows) == 1 and _no_driver(nvml_rows[0].text):
            # pynvml is a dependency, so every machine without an NVIDIA driver gets here: a note.
            reason = nvml_rows[0].text.removeprefix("probe failed: ")
            nvml_rows = [
                Row(
                    "NVML",
                    f"not used: no NVIDIA driver here ({reason}); the GPUs below are torch.cuda's",
                    status=Status.NOTE,
                )
            ]
            rows += nvml_rows
            nvml_rows = []
        else:
            rows += nvml_rows
    if not nvml_rows or any(row.status is Status.FAILED for row in nvml_rows):
        rows += run_probe("torch.cuda", lambda: torch_gpu_rows(sysfs))
    return rows


def _no_driver(text: str) -> bool:
    """Whether NVML failed for want of a driver (its library, or the kernel module), not a fault."""
    lowered = text.lower()
    return any(words in lowered for words in ("driver not loaded", "library not found", "librarynotfound"))


def _import_pynvml() -> ModuleType | str:
    """The pynvml module, or why there is none."""
    try:
        import pynvml
    except ImportError:
        return "pynvml is not installed (pip install nvidia-ml-py)"
    return pynvml


def nvml_gpu_rows(pynvml: Any, sysfs: Path = SYSFS_PCI) -> list[Row]:
    """The driver and every GPU NVML sees; an NVMLError at init (no driver, no device) raises,
    and the caller's probe turns it into a row."""
    pynvml.nvmlInit()
    try:
        rows = [Row("NVIDIA driver", _text(pynvml.nvmlSystemGetDriverVersion()))]
        rows += run_probe("CUDA driver API", lambda: [_cuda_driver_row(pynvml)])
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            facts = GpuFacts(label=f"GPU {index} (NVML)", name=_text(pynvml.nvmlDeviceGetName(handle)))
            _read(facts, "memory", partial(_nvml_memory, pynvml, handle, facts))
            _read(facts, "compute capability", partial(_nvml_capability, pynvml, handle, facts))
            _read(facts, "PCI bus id", partial(_nvml_bus, pynvml, handle, facts))
            _read(facts, "PCIe link", partial(_nvml_link, pynvml, handle, facts))
            _read_sysfs(facts, sysfs)
            rows.append(facts_row(facts))
        return rows
    finally:
        pynvml.nvmlShutdown()


def torch_gpu_rows(sysfs: Path = SYSFS_PCI) -> list[Row]:
    import torch  # lazily: the launcher's other paths never load it

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return [Row("CUDA devices", "none: this torch is a CPU-only build", 0)]
        return [
            Row(
                "CUDA devices",
                f"none visible: torch {torch.__version__} (CUDA {torch.version.cuda}) finds no device "
                "(no driver loaded, CUDA_VISIBLE_DEVICES empty, or no GPU)",
                0,
                Status.NOTE,
            )
        ]
    rows = [Row("CUDA devices", str(torch.cuda.device_count()), torch.cuda.device_count())]
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        facts = GpuFacts(
            label=f"GPU {index} (cuda:{index})",
            name=props.name,
            memory_total=int(props.total_memory),
            capability=f"{props.major}.{props.minor}",
        )
        domain = getattr(props, "pci_domain_id", None)
        bus = getattr(props, "pci_bus_id", None)
        device = getattr(props, "pci_device_id", None)
        if None in (domain, bus, device):
            facts.problems.append("PCI bus id: this torch does not report it")
        else:
            facts.bus_id = f"{domain:04x}:{bus:02x}:{device:02x}.0"
            _read_sysfs(facts, sysfs)
        rows.append(facts_row(facts))
    return rows


def facts_row(facts: GpuFacts) -> Row:
    parts = [facts.name]
    if facts.memory_total is not None:
        used = "" if facts.memory_used is None else f" ({format_bytes(facts.memory_used)} in use)"
        parts.append(f"{format_bytes(facts.memory_total)}{used}")
    if facts.capability:
        parts.append(f"compute capability {facts.capability}")
    gen_now, width_now = facts.link_now
    gen_max, width_max = facts.link_max
    if gen_now or width_now:
        link = f"PCIe gen {gen_now or '?'} x{width_now or '?'}"
        if gen_max or width_max:
            link += f" (card max gen {gen_max or '?'} x{width_max or '?'})"
        parts.append(link)
    if facts.numa_node is not None:
        parts.append(f"NUMA node {facts.numa_node}" if facts.numa_node >= 0 else "no NUMA node (one socket)")
    if facts.bus_id:
        parts.append(f"bus {facts.bus_id}")
    status = Status.OK
    if width_now and width_max and width_now < width_max:
        parts.append(f"the link runs at x{width_now} of the card's x{width_max}: copies to and from it slow down")
        status = Status.NOTE
    if facts.problems:
        parts.append("unread: " + "; ".join(facts.problems))
        status = Status.NOTE if status is Status.OK else status
    value = {
        "name": facts.name,
        "memory_total": facts.memory_total,
        "memory_used": facts.memory_used,
        "compute_capability": facts.capability,
        "pcie_now": {"generation": gen_now, "width": width_now},
        "pcie_max": {"generation": gen_max, "width": width_max},
        "numa_node": facts.numa_node,
        "bus_id": facts.bus_id,
    }
    return Row(facts.label, ", ".join(parts), value, status)


def _read(facts: GpuFacts, what: str, read: Callable[[], None]) -> None:
    """Run one NVML query; a failure is noted on the GPU's row, the rest is still read."""
    try:
        read()
    except Exception as err:  # noqa: BLE001 - NVML raises NVMLError_NotSupported and kin per query
        facts.problems.append(f"{what}: {describe(err)}")


def _nvml_memory(pynvml: Any, handle: Any, facts: GpuFacts) -> None:
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    facts.memory_total, facts.memory_used = int(info.total), int(info.used)


def _nvml_capability(pynvml: Any, handle: Any, facts: GpuFacts) -> None:
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    facts.capability = f"{major}.{minor}"


def _nvml_bus(pynvml: Any, handle: Any, facts: GpuFacts) -> None:
    facts.bus_id = sysfs_bus_id(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))


def _nvml_link(pynvml: Any, handle: Any, facts: GpuFacts) -> None:
    facts.link_now = (
        int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
        int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)),
    )
    facts.link_max = (
        int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
        int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)),
    )


def _cuda_driver_row(pynvml: Any) -> Row:
    query = getattr(pynvml, "nvmlSystemGetCudaDriverVersion_v2", None) or pynvml.nvmlSystemGetCudaDriverVersion
    version = int(query())  # e.g. 12040
    text = f"{version // 1000}.{version % 1000 // 10}"
    return Row("CUDA driver API", f"{text} (the newest CUDA runtime this driver serves)", text)


def _read_sysfs(facts: GpuFacts, sysfs: Path) -> None:
    """The link and the NUMA node from sysfs, where NVML gave none."""
    if facts.bus_id is None:
        return
    folder = sysfs / facts.bus_id
    if not folder.exists():
        facts.problems.append(f"sysfs: no {folder}")
        return
    if facts.link_now == (None, None):
        facts.link_now = (
            _generation(folder / "current_link_speed"),
            _int_file(folder / "current_link_width"),
        )
        facts.link_max = (_generation(folder / "max_link_speed"), _int_file(folder / "max_link_width"))
    if facts.numa_node is None:
        facts.numa_node = _int_file(folder / "numa_node")


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:18:00.0" as sysfs names it: "0000:18:00.0" (four-digit domain, lowercase)."""
    domain, _, rest = nvml_bus_id.strip().partition(":")
    return f"{int(domain, 16):04x}:{rest.lower()}"


def _generation(path: Path) -> int | None:
    """PCIe generation from a sysfs link speed such as "16.0 GT/s PCIe"."""
    try:
        rate = float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return GENERATION_BY_GT_S.get(rate)


def _int_file(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _text(value: str | bytes) -> str:
    """NVML returns bytes in older pynvml releases and str in newer ones."""
    return value.decode() if isinstance(value, bytes) else str(value)

"""What NVML (``pynvml``, the ``nvidia-ml-py`` package, a core dependency) says about the GPU a
rank trains on, where torch cannot see: the other processes holding its memory, its SM clock
limit, its PCIe link. Part of the device layer.

Every function returns None (or nothing) where NVML cannot answer (no driver, a GPU NVML does not
list, an old driver without the call): these facts explain figures, they never stop a run. NVML
numbers GPUs its own way and ignores ``CUDA_VISIBLE_DEVICES``; the PCI bus id ties a torch device
to its NVML handle.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

PCIE_GB_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
"""Usable GB/s per lane and direction, by PCIe generation (after line coding)."""


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int


@contextlib.contextmanager
def _handle(device: torch.device) -> Iterator[tuple[Any, Any] | None]:
    """(pynvml, the device's handle), or None; NVML is shut down after."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no GPU: NVML has nothing to say
        yield None
        return
    try:
        props = torch.cuda.get_device_properties(device)
        # torch's stub of _CudaDeviceProperties lacks the pci_* fields that its binding has
        pci = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)  # type: ignore[attr-defined]
        bus = "{:08x}:{:02x}:{:02x}.0".format(*pci)
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:  # noqa: BLE001 - a device NVML does not list
            handle = None
        yield None if handle is None else (pynvml, handle)
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def other_processes(device: torch.device) -> list[GpuProcess]:
    """Processes other than this one holding memory on ``device``, the largest first."""
    with _handle(device) as found:
        if found is None:
            return []
        pynvml, handle = found
        try:
            running = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except Exception:  # noqa: BLE001 - not supported by this driver
            return []
    held = [
        GpuProcess(pid=int(p.pid), name=_process_name(int(p.pid)), used_bytes=int(p.usedGpuMemory or 0))
        for p in running
        if int(p.pid) != os.getpid()
    ]
    return sorted(held, key=lambda p: p.used_bytes, reverse=True)


def max_sm_clock_mhz(device: torch.device) -> int | None:
    """The highest SM clock the GPU may run at now: its application clock target where one is
    set (a locked or capped card), else its maximum."""
    with _handle(device) as found:
        if found is None:
            return None
        pynvml, handle = found
        for read in (
            lambda: pynvml.nvmlDeviceGetApplicationsClock(handle, pynvml.NVML_CLOCK_SM),
            lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
        ):
            with contextlib.suppress(Exception):
                mhz = int(read())
                if mhz > 0:
                    return mhz
    return None


def pcie_link(device: torch.device) -> tuple[int, int] | None:
    """(generation, lanes) of the GPU's PCIe link at its best (the link drops a generation while
    the GPU idles, so the current one says little about a copy)."""
    with _handle(device) as found:
        if found is None:
            return None
        pynvml, handle = found
        try:
            generation = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
            return generation, int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
        except Exception:  # noqa: BLE001 - no PCIe (SXM over NVLink-C2C), or an old driver
            return None


def describe_link(link: tuple[int, int] | None) -> str:
    """ "PCIe gen 4 x16 (31.5 GB/s each way)", or "" when unknown."""
    if link is None:
        return ""
    generation, lanes = link
    per_lane = PCIE_GB_PER_LANE.get(generation)
    rate = f" ({per_lane * lanes:.1f} GB/s each way)" if per_lane is not None else ""
    return f"PCIe gen {generation} x{lanes}{rate}"


def _process_name(pid: int) -> str:
    try:
        import psutil

        return str(psutil.Process(pid).name())
    except Exception:  # noqa: BLE001 - gone, or another user's
        return "?"

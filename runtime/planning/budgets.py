"""Per-rank memory budgets when the spec says "auto"."""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch
from torch import nn

from protrain.runtime.config.settings import PlanningSettings
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.host_capacity import free_host_bytes
from protrain.runtime.hw.nvml import other_processes

DEVICE_RESERVE_FRACTION = 0.05
"""Kept free on a CUDA device for the CUDA context, NCCL and allocator slack."""
HOST_RESERVE_BYTES = 2 << 30
"""Kept free on the host for the OS, the Python process and data loading."""


def auto_device_budget(device: DeviceInfo, ranks_on_host: int) -> int:
    """CUDA: what the device has free for this process, less a reserve. CPU: this rank's share
    of available RAM, so plans stay resident unless the spec sets a smaller budget."""
    if device.is_cuda:
        return _cuda_free_for_us(device)
    return max(0, psutil.virtual_memory().available - HOST_RESERVE_BYTES) // max(1, ranks_on_host)


def _cuda_free_for_us(device: DeviceInfo) -> int:
    """What the device has free for this process now (``mem_get_info``'s free figure, plus the
    blocks this process's allocator holds: its own), less the reserve. Other processes' memory is
    not ours: when they hold some, the budget says so, naming them (NVML)."""
    free, total = torch.cuda.mem_get_info(device.device)
    ours = torch.cuda.memory_reserved(device.device)
    reserve = int(total * DEVICE_RESERVE_FRACTION)
    budget = max(0, int(free) + int(ours) - reserve)
    others = other_processes(device.device)
    if others:
        held = ", ".join(f"pid {p.pid} {p.name} ({p.used_bytes / 2**30:.1f} GiB)" for p in others[:5])
        print(
            f"protrain: memory.device_budget auto: {budget / 2**30:.1f} GiB of {device.device}'s "
            f"{total / 2**30:.1f} GiB; other processes hold memory there: {held}",
            flush=True,
        )
    return budget


def auto_host_budget(ranks_on_host: int, *, free_bytes: Callable[[], int] | None = None) -> int:
    """(what the node has free for the job - reserve) / ranks on this host, plus what this
    process holds already (the host budget is what a rank's process may hold in all): the free
    figure is the smallest of available RAM, the cgroup headroom and Slurm's allocation
    (``runtime.hw.host_capacity``), or ``free_bytes()`` where given (a test's)."""
    free = free_host_bytes(ranks_on_host=ranks_on_host)[0] if free_bytes is None else free_bytes()
    share = max(0, free - HOST_RESERVE_BYTES) // max(1, ranks_on_host)
    return share + process_rss_bytes()


def process_rss_bytes() -> int:
    """What this process holds in host memory now (resident set)."""
    return int(psutil.Process().memory_info().rss)


def host_parameter_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters in host memory, each storage once: what the chunks take
    over (the parameters then view chunk memory and their own storages are freed), so the host
    holds them twice only while the model is chunked."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for p in model.parameters()
        if p.device.type == "cpu"
    }
    return sum(storages.values())


def resolve_budgets(settings: PlanningSettings, device: DeviceInfo, *, ranks_on_host: int) -> tuple[int, int]:
    """(device, host) budget bytes of this rank: the spec's, or measured where it says auto."""
    device_budget = settings.device_budget_bytes
    if device_budget is None:
        device_budget = auto_device_budget(device, ranks_on_host)
    host_budget = settings.host_budget_bytes
    if host_budget is None:
        host_budget = auto_host_budget(ranks_on_host)
    return device_budget, host_budget

"""The device layer: which device a rank computes on, and what it offers.

Real on CUDA; on CPU a faithful stand-in so every path runs and is tested without a GPU. The
chunk engine extends this module with streams, events, pinned allocation and memory statistics;
nothing else in the runtime talks to ``torch.cuda`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    device: torch.device
    backend: str
    """Process-group backend that fits the device: nccl on CUDA, gloo on CPU."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def autocast_type(self) -> str:
        return self.device.type


def select_device(local_rank: int) -> DeviceInfo:
    """CUDA device ``local_rank`` when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return DeviceInfo(torch.device("cuda", index), "nccl")
    return DeviceInfo(torch.device("cpu"), "gloo")


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def synchronize(info: DeviceInfo) -> None:
    """Wait for queued device work (for honest step times)."""
    if info.is_cuda:
        torch.cuda.synchronize(info.device)

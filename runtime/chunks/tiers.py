"""Where a chunk's state lives: the tiers its tensors are placed in.

- The device tier: the compute device. Persistent chunks keep everything there (their full
  compute copy, fp32 master, gradient and optimizer state).
- The host tier: host memory. Offloaded chunks keep their state there, in one region sized
  exactly as profiler/host_bytes.py counts it (the arena; pinned on CUDA so copies run beside
  compute), or, where no chunk is offloaded, in ordinary host tensors.

Every placement and every "is this host state?" question goes through here.
- The NVMe tier (``memory.ssd.n_optimizer``): the last offloaded chunks' optimizer state in files,
  updated in a few host slots (nvme_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protrain.runtime.chunks.nvme_state import NvmeStateTier
from protrain.runtime.hw import device_wall
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.host_memory import MmapArena


@dataclass(frozen=True, slots=True)
class DeviceTier:
    device: DeviceInfo

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device.device)

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device.device, copy=True)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in device memory (on CPU: anywhere, the host arena included)."""
        return tensor.device == self.device.device


@dataclass(frozen=True, slots=True)
class HostTier:
    arena: MmapArena | None
    """The offloaded chunks' region (None: no chunk is offloaded)."""

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.arena is None:
            with device_wall.host_allocations():
                return torch.zeros(numel, dtype=dtype)
        return self.arena.allocate(numel, dtype)  # mmap pages start zeroed

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.arena is None:
            with device_wall.host_allocations():
                return tensor.detach().to("cpu", copy=True)
        out = self.arena.allocate(tensor.numel(), tensor.dtype)
        out.copy_(tensor.reshape(-1))
        return out

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.arena is None:
            return torch.empty_like(tensor, device="cpu")
        return self.arena.allocate(tensor.numel(), tensor.dtype)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in the region (on CPU, device and host are one memory)."""
        return self.arena is not None and self.arena.contains(tensor)


@dataclass(frozen=True, slots=True)
class StateTiers:
    """The tiers of one chunk store."""

    device: DeviceTier
    host: HostTier
    nvme: NvmeStateTier | None = None
    """The last offloaded chunks' optimizer state in files (nvme_state.py), if any."""

    def for_chunk(self, *, persistent: bool) -> DeviceTier | HostTier:
        """Where a chunk's state lives: persistent on the device, offloaded on the host."""
        return self.device if persistent else self.host

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is chunk state in host memory (not on the compute device)."""
        in_slots = self.nvme is not None and self.nvme.holds_tensor(tensor)
        return not self.device.holds(tensor) or self.host.holds(tensor) or in_slots

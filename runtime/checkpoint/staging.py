"""Device state through one host buffer: a save or a load moves the compute device's tensors (the
persistent chunks' state) one piece at a time, so it adds one piece of host memory, not the whole
device state.

DCP reads and writes only host tensors. In the state dict, each device piece is a *placeholder*:
a host tensor of the piece's shape over the front of one reused buffer (sized to the largest
piece), registered with the device tensor it stands for. ``StagingSavePlanner.resolve_data``
copies the device piece into its placeholder just before DCP writes it; ``StagingLoadPlanner``
lets DCP read into the placeholder and ``commit_tensor`` copies it to the device at once. Both
rely on DCP handling one item at a time: its file reader always does; its file writer does with
``per_thread_copy_ahead=0`` (``_SerialCpuLoader``: each item is written before the next is
resolved; the overlapping loader would resolve several ahead into the same buffer).

On CPU the "device" tier is host RAM, and its tensors take the same path (copied as a GPU's
would be), so the suite measures what a save adds on a GPU.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

from protrain.runtime.hw import device_wall


def exact_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory (contiguous, on the host) as a tensor whose storage is exactly its
    bytes, so a writer that copies views of larger storages writes it as it is. The alias keeps
    ``tensor``, and so its memory, alive."""
    if tensor.device.type != "cpu" or tensor.numel() == 0 or tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    if not tensor.is_contiguous():
        raise ValueError("exact_alias needs a contiguous tensor")
    memory = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    memory._owner = tensor  # type: ignore[attr-defined]
    return torch.frombuffer(memory, dtype=tensor.dtype).view(tensor.shape)


Key = tuple[str, tuple[int, ...]]
"""A DCP item: the state dict key and the offsets of the local tensor in its global tensor."""


class DeviceStaging:
    """One host buffer of ``nbytes`` and the device pieces whose placeholders it backs."""

    def __init__(self, nbytes: int) -> None:
        with device_wall.host_allocations():
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        self._sources: dict[Key, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return self._buffer.numel()

    def placeholder(self, name: str, offsets: Sequence[int], source: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like ``source`` standing for it in the state dict under ``name``
        at ``offsets`` (its content is the piece's only while DCP handles that item)."""
        nbytes = source.numel() * source.element_size()
        if nbytes > self.nbytes:
            raise ValueError(f"{name}: a piece of {nbytes:,} bytes does not fit the {self.nbytes:,}-byte buffer")
        self._sources[(name, tuple(offsets))] = source
        return exact_alias(self._buffer[:nbytes].view(source.dtype).view(source.shape))

    def source(self, index: MetadataIndex) -> torch.Tensor | None:
        """The device piece an item's placeholder stands for (None: the item is host state)."""
        offsets = tuple(index.offset) if index.offset is not None else ()
        return self._sources.get((index.fqn, offsets))


class StagingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with each device piece copied into its placeholder as DCP
    resolves it."""

    def __init__(self, staging: DeviceStaging | None) -> None:
        super().__init__()
        self.staging = staging

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        source = None if self.staging is None else self.staging.source(write_item.index)
        if source is not None:
            assert isinstance(data, torch.Tensor)
            data.copy_(source)
        return data


class StagingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with each device piece's placeholder copied to the device as
    soon as DCP has read into it."""

    def __init__(self, staging: DeviceStaging | None) -> None:
        super().__init__()
        self.staging = staging

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        source = None if self.staging is None else self.staging.source(read_item.dest_index)
        if source is not None:
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
                source = source.narrow(dim, start, length)
            source.copy_(tensor)

"""What the saved-tensor dispatcher keeps for an offloaded activation.

Autograd asks the pack hook to keep each tensor an operator saves for backward. For blocks whose
activations leave the device, the dispatcher keeps instead:

- one ``StoredStorage`` per distinct storage saved in a step: its bytes travel to host memory
  (swap) or a file (ssd) once, however many saved tensors view it (deduplication);
- one ``SavedActivation`` per saved tensor: the storage record plus the tensor's exact dtype,
  size, stride and storage offset, so that views of one storage (q, k, v split from a fused
  projection: same shape and stride, different offsets) come back as the very same views.

A record is recognised again by its storage's address while that storage is alive (a weak
reference to the storage itself tells; a freed address may be reused by a new tensor). It lives
while any of its saved tensors does: autograd drops a saved tensor after using it, or when the
graph is freed, and the record's host memory or file goes with the last one.

``ActivationStats`` counts what happened to them, for tests and benchmarks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from protrain.profiler.plan import BlockMode


class KeptTensor:
    """A saved tensor the dispatcher keeps where it is. Autograd skips its own in-place check
    for tensors that pass through saved-tensor hooks, so the version is noted here and checked
    when backward unpacks it, with autograd's message.

    It holds a detached alias (same memory, same version counter), never the tensor itself: an
    output saved by the node that made it would then hold its own node (tensor -> grad_fn ->
    saved variable -> tensor), a cycle through C++ the garbage collector cannot see, which a
    forward never followed by its backward (an error between them, a profiling step that ran
    out of memory) leaked with every activation of the step."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        tensor = self.tensor
        if tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
                f"{tensor._version}; expected version {self.version} instead"
            )
        return tensor


class SavedTensorModifiedError(RuntimeError):
    """A tensor saved for backward was changed in place after it was saved (autograd's own
    'modified by an inplace operation' error, raised for offloaded activations too)."""


@dataclass(eq=False)
class StoredStorage:
    """One storage saved by an offloaded block: where its bytes are during the step."""

    block: int
    mode: BlockMode
    nbytes: int
    device: torch.device
    address: int
    """The original storage's address: the key it is filed under while that storage lives."""
    weak: StorageWeakRef
    """The original storage, to recognise it when it is saved again (deduplication)."""
    source: torch.Tensor | None
    """uint8 view of the original storage, held while its copy or write is in flight; it is
    also served to backward if still here (forwarding)."""
    host: torch.Tensor | None = None
    """swap (and ssd on CUDA, as a staging copy): the bytes in host memory."""
    file: Any = None
    """ssd: the ActivationFile holding the bytes."""
    outbound: Any = None
    """The DeviceEvent of the copy to host, while it may be in flight."""
    restored: torch.Tensor | None = None
    """uint8 bytes back on the device for backward."""
    inbound: Any = None
    """The DeviceEvent (swap) or PendingRead (ssd) bringing the bytes back."""
    live: int = 0
    """Saved tensors that still refer to this record."""
    watched: list[tuple[weakref.ref[torch.Tensor], int]] = field(default_factory=list)
    """(tensor, version when saved) of each saved tensor and its base, once its block's forward
    has ended: an in-place change through any of them that is still alive is noticed."""
    modified: str | None = None
    released: bool = False
    lost: str | None = None
    """ssd: why its bytes were dropped before they came back (a step failed on an I/O error and
    its files were removed at once); backward cannot have them."""

    def check_versions(self) -> None:
        """Note (in ``modified``) the first saved tensor whose version moved since it was saved."""
        if self.modified is not None:
            return
        for ref, version in self.watched:
            tensor = ref()
            if tensor is not None:
                self.check_version(tensor, version)

    def check_version(self, tensor: torch.Tensor, version: int) -> None:
        if self.modified is None and tensor._version != version:
            self.modified = _describe_modified(tensor, version, self)

    def watch(self, tensor: torch.Tensor, version: int) -> None:
        self.watched.append((weakref.ref(tensor), version))
        base = tensor._base
        if base is not None:  # a change through the base moves the same version counter
            self.watched.append((weakref.ref(base), version))


@dataclass(slots=True)
class ActivationStats:
    """Counters since the engine started (tests and benchmarks read them)."""

    records: int = 0
    """Distinct storages sent away (swap or ssd)."""
    dedup_hits: int = 0
    """Saved tensors whose storage was already on its way (no second copy or file)."""
    bytes_swapped_out: int = 0
    bytes_swapped_in: int = 0
    bytes_to_ssd: int = 0
    bytes_from_ssd: int = 0
    forwarded: int = 0
    """Records served from memory in backward, their copy or write still in flight."""
    served_live: int = 0
    """Saved tensors served in backward from the original, still held elsewhere."""
    kept_small: int = 0
    wait_s: float = 0.0
    """Seconds compute waited for activation transfers (exposed I/O): for bytes to come back
    in backward, and for room among the writes in flight in forward."""


class SavedActivation:
    """What autograd keeps for one saved tensor of an offloaded block."""

    __slots__ = ("record", "dtype", "size", "stride", "offset", "version", "tensor_ref", "_on_release")

    def __init__(
        self,
        record: StoredStorage,
        tensor: torch.Tensor,
        on_release: Callable[[StoredStorage], None],
    ) -> None:
        self.record = record
        self.dtype = tensor.dtype
        self.size = tuple(tensor.size())
        self.stride = tuple(tensor.stride())
        self.offset = tensor.storage_offset()
        self.version = tensor._version
        self.tensor_ref = weakref.ref(tensor)
        self._on_release = on_release
        record.live += 1

    def live_tensor(self) -> torch.Tensor | None:
        """The original tensor if something else still holds it (served without a transfer);
        raises if it was modified in place since it was saved."""
        tensor = self.tensor_ref()
        if tensor is None:
            return None
        if tensor._version != self.version:
            raise SavedTensorModifiedError(_describe_modified(tensor, self.version, self.record))
        return tensor

    def view_of(self, data: torch.Tensor) -> torch.Tensor:
        """This saved tensor as a view of the storage bytes ``data`` (uint8, whole storage)."""
        return data.view(self.dtype).as_strided(self.size, self.stride, self.offset)

    def __del__(self) -> None:
        try:
            self._on_release(self.record)
        except Exception:  # noqa: BLE001 - a finaliser must not raise (interpreter shutdown)
            pass


def _describe_modified(tensor: torch.Tensor, version: int, record: StoredStorage) -> str:
    return (
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: a {tensor.dtype} tensor of shape {list(tensor.shape)} saved by block "
        f"{record.block} ({record.mode.value}) is at version {tensor._version}; expected version "
        f"{version} instead. Clone it before changing it in place."
    )

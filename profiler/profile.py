"""What the planner knows about the machine and the model: plain, saved values.

``HardwareProfile`` holds measured rates and capacities of one rank's machine (runtime/planning/hardware_probes.py
measures them); ``ModelProfile`` holds what one profiling step of the model showed (per block
time and activation bytes, the transient peak, the parameters in execution order). Both are
keyed by names and numbers, never live objects, and round-trip exactly through JSON so they can
be cached and shipped (what-if planning builds them from descriptions instead).

This module imports nothing of ours and not torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

PROFILE_VERSION = 6

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    """Rates and capacities seen by one rank (times are per rank, bytes per rank)."""

    version: int = PROFILE_VERSION
    device_kind: str
    """e.g. "cpu" or "cuda:NVIDIA H100 80GB HBM3"."""
    world_size: int
    h2d_bytes_per_s: float
    """Host tier -> device tier copy rate (pinned on CUDA; a memcpy on CPU)."""
    d2h_bytes_per_s: float
    cpu_adam_params_per_s: float
    """The job's optimizer (``optimizer``; AdamW unless named) over fp32 shards on the host, on
    the thread the engine gives it (named for Adam, the usual one)."""
    device_adam_params_per_s: float
    all_gather_bytes_per_s: float
    """Output bytes (the whole chunk) per second at this world size; inf for one rank."""
    reduce_scatter_bytes_per_s: float
    """Input bytes (the whole chunk) per second at this world size; inf for one rank."""
    all_reduce_bytes_per_s: float = float("inf")
    """Bytes (the whole chunk) per second of an all-reduce at this world size (a replicated
    chunk's gradients); inf for one rank."""
    collective_latency_s: float
    """Fixed cost of one collective call (0 for one rank)."""
    adam_segment_s: float = 0.0
    """Fixed cost per parameter segment of one Adam call (the optimizer's per-tensor work)."""
    optimizer: str = "adamw"
    """The optimizer rule the two update rates and the segment cost were measured with ("sgd"
    with momentum: "sgd+momentum")."""
    memory_bytes_per_s: float = float("inf")
    """Copy rate within the device tier (fp32 bytes copied per second): the norm and zeroing
    passes over persistent chunks' gradient shards."""
    host_copy_bytes_per_s: float = float("inf")
    """The same in host memory on the host worker's threads: the passes over host gradient
    shards. On a GPU machine 50 to 100 times below the device's; on CPU both are one memory."""
    host_downcast_bytes_per_s: float = float("inf")
    """fp32 to 16-bit in host memory on the host worker's threads, bytes read and written per
    second: master shards downcast for upload, gradients widened to fp32."""
    host_add_bytes_per_s: float = float("inf")
    """A 16-bit gradient widened and added into an fp32 shard on the host worker's threads,
    bytes read and written per second (2 + 4 + 4 per element)."""
    host_shared_factor: float = 1.0
    """The share of the host rates left while a CPU Adam runs on the other cores: the ranks of a
    node share its memory, so with several ranks the host terms use the rates times this."""
    copies_overlap_compute: bool = True
    """Transfers, collectives and the CPU-Adam thread run beside compute (CUDA: copy engines,
    NCCL, host cores). False on CPU, where they use the cores compute uses: they add to the step."""
    link: str = ""
    """The host-device link as NVML describes it ("PCIe gen 4 x16 (31.5 GB/s each way)"), or ""."""
    ssd_write_bytes_per_s: float = 0.0
    """Write rate of ``memory.ssd.path`` as activation files are written (O_DIRECT where the
    filesystem allows); 0 when no path was measured, and then no plan puts blocks on disk."""
    ssd_read_bytes_per_s: float = 0.0
    ssd_ranks_sharing: int = 1
    """Ranks of a host writing to the same drive at once (its local ranks): each gets this share
    of the rates above, which are one process's."""
    library_workspace_bytes: int = 0
    """Device memory the math libraries keep beside the model (cuBLAS's workspace for each
    thread that runs matrix products; runtime/hw/math_workspaces.py): part of every plan's peak.
    Measured at every planning (not read from the cache); 0 on CPU."""

    def host_rates(self) -> tuple[float, float, float]:
        """(copy, downcast, add) rates of host work: the host worker's, shared with the node's
        other ranks when there are several (each runs its CPU Adam at the same time)."""
        share = self.host_shared_factor if self.world_size > 1 else 1.0
        return (
            self.host_copy_bytes_per_s * share,
            self.host_downcast_bytes_per_s * share,
            self.host_add_bytes_per_s * share,
        )

    def ssd_rates(self) -> tuple[float, float]:
        """(write, read) bytes per second of the disk for one rank, its share of the drive."""
        share = max(1, self.ssd_ranks_sharing)
        return self.ssd_write_bytes_per_s / share, self.ssd_read_bytes_per_s / share

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        return _from_dict(cls, data)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockProfile:
    forward_s: float
    backward_s: float
    activation_bytes: int
    """Bytes the block's forward saves for backward (each storage once; parameters excluded)."""
    input_bytes: int = 0
    """Bytes of the tensors the block is called with: what a checkpointed block keeps."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """One micro-batch of the model at the profiled batch shape, on this machine."""

    version: int = PROFILE_VERSION
    batch_shape: tuple[int, ...]
    """Shape of the profiled batch's main input; plans made from it hold for no larger batch."""
    precision: str
    element_size: int
    """Bytes per element of the chunked compute copy of the parameters."""
    param_sizes: tuple[tuple[int, bool], ...]
    """(numel, trainable) of each unique parameter, in execution order."""
    param_block: tuple[int, ...]
    """Index of the block that owns each parameter; -1 for parameters outside the blocks."""
    module_params: tuple[tuple[int, ...], ...]
    """Per module, the indices of its own parameters (they must be resident together)."""
    blocks: tuple[BlockProfile, ...]
    other_forward_s: float
    """Forward time outside the blocks (embeddings, final norm, head, loss)."""
    other_backward_s: float
    other_activation_bytes: int
    transient_bytes: int
    """Peak bytes beyond model state and the activations saved for backward: temporaries inside
    and between operators, the loss, gradients in flight."""

    def __post_init__(self) -> None:
        if len(self.param_block) != len(self.param_sizes):
            raise ValueError("param_block must give one block index per parameter")
        if any(index >= len(self.blocks) or index < -1 for index in self.param_block):
            raise ValueError("param_block refers to a block that is not profiled")

    @property
    def forward_s(self) -> float:
        return self.other_forward_s + sum(block.forward_s for block in self.blocks)

    @property
    def backward_s(self) -> float:
        return self.other_backward_s + sum(block.backward_s for block in self.blocks)

    @property
    def activation_bytes(self) -> int:
        return self.other_activation_bytes + sum(block.activation_bytes for block in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        body = dict(data)
        body["batch_shape"] = tuple(body.get("batch_shape", ()))
        body["param_sizes"] = tuple((int(n), bool(t)) for n, t in body.get("param_sizes", ()))
        body["param_block"] = tuple(body.get("param_block", ()))
        body["module_params"] = tuple(tuple(m) for m in body.get("module_params", ()))
        body["blocks"] = tuple(BlockProfile(**b) for b in body.get("blocks", ()))
        return _from_dict(cls, body)


def _from_dict(cls: type[T], data: dict[str, Any]) -> T:
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {', '.join(unknown)}")
    if data.get("version", PROFILE_VERSION) != PROFILE_VERSION:
        raise ValueError(f"{cls.__name__} version {data.get('version')} is not {PROFILE_VERSION}")
    return cls(**data)


def cache_key(*parts: object) -> str:
    """A stable short key of plain values (model structure, batch shape, precision, world size,
    hardware), for naming cached profiles."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

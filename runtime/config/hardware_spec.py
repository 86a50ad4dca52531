"""Hardware description files for what-if planning (``configs/hardware/*.yaml``): a machine that
is not here, described by its capacities and rates. Validated as strictly as the job spec (unknown
keys, wrong types and bad sizes are errors naming the file and the key). Does not import torch.

Rates are written as sizes per second (``host_to_device: 25GB`` means 25 GB/s).
"""

from __future__ import annotations

import os

from pydantic import ValidationError

from protrain.runtime.config.spec_io import SpecError, format_validation_error, read_spec_file
from protrain.runtime.config.spec_types import Fraction, PositiveFloat, PositiveInt, Size, SpecModel, Text


class GpuSpec(SpecModel):
    """One kind of accelerator, ``count`` of them in the machine (one rank each)."""

    name: Text
    """e.g. "NVIDIA A100-SXM4-80GB"."""
    memory: Size
    """Device memory per GPU."""
    count: PositiveInt = 1
    tflops: PositiveFloat
    """Dense 16-bit peak, TFLOP/s."""
    mfu: Fraction = 0.45
    """Share of the peak that transformer matmuls sustain (model FLOPs utilisation)."""
    memory_bandwidth: Size
    """Device memory bandwidth per second (the device Adam is bound by it)."""
    host_to_device: Size
    """Pinned host -> device copy rate per second (PCIe or NVLink-C2C)."""
    device_to_host: Size
    collective_bandwidth: Size = 100_000_000_000
    """All-gather / reduce-scatter bytes per second per GPU across the GPUs of the machine."""


class HostSpec(SpecModel):
    memory: Size
    """Host RAM of the machine (shared by its GPUs' ranks)."""
    cpu_adam_params_per_s: PositiveFloat
    """CPU AdamW throughput, fp32 parameters per second, per rank."""
    memory_bandwidth: Size = 20_000_000_000
    """Bytes per second one rank's host work reads and writes (downcasts, gradient adds, norms),
    on the host worker's few threads: not the socket's peak, and shared with the node's other
    ranks."""


class SsdSpec(SpecModel):
    read_bandwidth: Size
    write_bandwidth: Size
    capacity: Size | None = None
    """Bytes the drive holds for activation files and optimizer state, shared by the machine's
    ranks; null: not limited."""


class HardwareFile(SpecModel):
    """A machine for what-if planning."""

    name: Text
    gpu: GpuSpec
    host: HostSpec
    ssd: SsdSpec | None = None


def load_hardware(path: str | os.PathLike[str]) -> HardwareFile:
    """The hardware file at ``path``, or SpecError naming the file, the key and what is allowed."""
    data = read_spec_file(path)
    try:
        return HardwareFile.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, source=str(path), root=HardwareFile)) from None

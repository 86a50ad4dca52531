"""The machine a what-if plans for: a hardware file's rates and budgets as the planner's
``HardwareProfile``, and its update rates for the job's optimizer rule."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from protrain.profiler.profile import HardwareProfile
from protrain.runtime.config.hardware_spec import HardwareFile
from protrain.runtime.optim.registry import ADAMW
from protrain.runtime.optim.rule import OptimizerRule

DEVICE_RESERVE_FRACTION = 0.05
"""As runtime/planning/budgets.py: kept free on a CUDA device for the context, NCCL and allocator slack."""
HOST_RESERVE_BYTES = 2 << 30


@dataclass(frozen=True, slots=True)
class Machine:
    hardware: HardwareProfile
    device_budget: int
    host_budget: int
    sustained_flops: float
    disk_bytes: int | None = None
    """A rank's share of the drive (the hardware file's ssd capacity); None: not limited."""


def machine_from_file(spec: HardwareFile) -> Machine:
    gpu = spec.gpu
    world = gpu.count
    collective = float(gpu.collective_bandwidth) if world > 1 else float("inf")
    hardware = HardwareProfile(
        device_kind=f"what-if:{gpu.name}",
        world_size=world,
        h2d_bytes_per_s=float(gpu.host_to_device),
        d2h_bytes_per_s=float(gpu.device_to_host),
        cpu_adam_params_per_s=spec.host.cpu_adam_params_per_s,
        # Device AdamW reads and writes ~28 bytes per parameter: bound by memory bandwidth.
        device_adam_params_per_s=gpu.memory_bandwidth / 28,
        all_gather_bytes_per_s=collective,
        reduce_scatter_bytes_per_s=collective,
        collective_latency_s=20e-6 if world > 1 else 0.0,
        adam_segment_s=10e-6,  # a fused multi-tensor kernel launch per few parameters
        memory_bytes_per_s=float(gpu.memory_bandwidth) / 2,  # a copy reads and writes
        host_copy_bytes_per_s=float(spec.host.memory_bandwidth) / 2,
        host_downcast_bytes_per_s=float(spec.host.memory_bandwidth),
        host_add_bytes_per_s=float(spec.host.memory_bandwidth),
        copies_overlap_compute=True,
        ssd_write_bytes_per_s=float(spec.ssd.write_bandwidth) if spec.ssd else 0.0,
        ssd_read_bytes_per_s=float(spec.ssd.read_bandwidth) if spec.ssd else 0.0,
        ssd_ranks_sharing=world,  # the host's GPUs' ranks share its drive
    )
    return Machine(
        hardware=hardware,
        device_budget=int(gpu.memory * (1 - DEVICE_RESERVE_FRACTION)),
        host_budget=max(0, spec.host.memory - HOST_RESERVE_BYTES) // world,
        sustained_flops=gpu.tflops * 1e12 * gpu.mfu,
        disk_bytes=None if spec.ssd is None or spec.ssd.capacity is None else spec.ssd.capacity // world,
    )


def with_optimizer(machine: Machine, rule: OptimizerRule) -> Machine:
    """The machine's update rates for ``rule``: a hardware file states AdamW's host rate, and
    both rates scale by the bytes an update moves per parameter (the update is memory bound)."""
    if rule.bytes_moved == ADAMW.bytes_moved:
        return machine
    factor = ADAMW.bytes_moved / rule.bytes_moved
    hardware = dataclasses.replace(
        machine.hardware,
        cpu_adam_params_per_s=machine.hardware.cpu_adam_params_per_s * factor,
        device_adam_params_per_s=machine.hardware.device_adam_params_per_s * factor,
        optimizer=rule.name,
    )
    return dataclasses.replace(machine, hardware=hardware)

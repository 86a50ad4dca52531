"""The measuring functions and clocks an engine calls, in one value ``initialize`` takes: tests and
benchmarks give their own to count, time or fake them, so none monkeypatches a module."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from protrain.profiler.profile import HardwareProfile, ModelProfile
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.device import synchronize as wait_for_device
from protrain.runtime.hw.math_workspaces import library_workspace_bytes
from protrain.runtime.model_io.weights import held_on
from protrain.runtime.planning.budgets import auto_device_budget
from protrain.runtime.planning.hardware_probes import hardware_profile
from protrain.runtime.planning.model_profiling import profile_model


@dataclass(frozen=True, slots=True, kw_only=True)
class Profilers:
    """The measuring functions an engine calls: the Planner's (``runtime.planning.model_profiling.profile_model``
    and ``runtime.planning.hardware_probes.hardware_profile``, same signatures) and the clocks
    its updates are timed on. Tests and benchmarks give their own, to count or fake them."""

    model: Callable[..., ModelProfile] = profile_model
    hardware: Callable[..., HardwareProfile] = hardware_profile
    clock: Callable[[], float] = time.perf_counter
    """The step clock: read at a window's first forward and after its update."""
    compute_clock: Callable[[], float] = time.perf_counter
    """Where compute runs on the host (CPU), the clock the forward and backward phases are
    timed on (on CUDA the phases are device events)."""
    synchronize: Callable[[DeviceInfo], None] = wait_for_device
    """Waits for the device, at the end of an update whose time is read."""
    holds_model: Callable[[nn.Module, torch.device], bool] = held_on
    """Whether the model's parameters are all on the device already, so that it is profiled
    whole there (else through its chunks; a test gives False to run as on a GPU, the model in
    host memory)."""
    library_workspaces: Callable[[DeviceInfo], int] = library_workspace_bytes
    """The math libraries' device workspaces (runtime/hw/math_workspaces.py: 0 on CPU, where a
    test gives its own to plan as on a GPU)."""
    device_capacity: Callable[[DeviceInfo, int], int] = auto_device_budget
    """What ``memory.device_budget: auto`` may take before other engines' claims (the device
    and the ranks on this host): free device memory less a reserve, on CPU a share of RAM."""

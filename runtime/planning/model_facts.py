"""What planning needs to know of the model and the spec's knobs, as plain functions: the block
list, the parameters each module owns, the bytes a plan's model state takes on the device, and
the hand-set knobs refused before any profiling (no plan could honour them, or a plan cannot run).

The plan itself is made by ``runtime.planning.planner.Planner``; these functions are shared by it,
``initialize``, the dry run and ``apply_plan``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from protrain.profiler.chunking import pack, persistent_chunk_bytes, search_chunk_bytes
from protrain.profiler.feasibility import chunk_knob_conflict, spec_size
from protrain.profiler.host_bytes import offloaded_region_bytes
from protrain.profiler.plan import Plan
from protrain.profiler.plan_builder import KnobRequest, activations_searchable
from protrain.runtime.blocks import BlocksNotFoundError, find_blocks
from protrain.runtime.chunks.layout import ParamInfo, first_use_order
from protrain.runtime.config.settings import PlanningSettings
from protrain.runtime.config.spec import Precision
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.data.batches import call_model
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.model_io.weights import held_on, stand_ins

COMPUTE_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
}
AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
"""The autocast dtype of forward under each mixed precision (fp32 runs without autocast)."""


def autocast(precision: Precision, device: DeviceInfo) -> contextlib.AbstractContextManager[Any]:
    """The training forward's autocast under ``precision`` (none for fp32)."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.autocast_type, dtype=dtype)


def compute_element_size(precision: Precision) -> int:
    """Bytes per element of the chunked compute copy of the parameters."""
    return 4 if precision is Precision.FP32 else 2


def model_blocks(model: nn.Module, settings: PlanningSettings) -> tuple[str, list[nn.Module]]:
    """The model's block list (path and blocks). A model with no recognisable block list gets
    none when nothing asks for per-block activation modes (they then simply stay resident)."""
    request = settings.request
    wants_modes = request.block_modes is not None or any(
        value not in (None, 0) for value in (request.n_swap, request.n_checkpoint, request.n_offload)
    )
    try:
        return find_blocks(model, settings.blocks_path)
    except BlocksNotFoundError as err:
        if settings.blocks_path is not None or wants_modes:
            raise SpecError(str(err)) from None
        return "", []


def module_params(model: nn.Module, params: tuple[ParamInfo, ...]) -> list[list[int]]:
    """Per module, the indices into ``params`` of its own (not its children's) parameters."""
    index_of_name = {name: i for i, info in enumerate(params) for name in (info.name, *info.aliases)}
    index_of_id = {
        id(param): index_of_name[name]
        for name, param in model.named_parameters(remove_duplicate=False)
        if name in index_of_name
    }
    return [
        [index_of_id[id(param)] for param in module.parameters(recurse=False) if id(param) in index_of_id]
        for module in model.modules()
    ]


def is_searchable(request: KnobRequest, *, num_blocks: int) -> bool:
    """Whether any knob is left to the search (and so a profile is wanted). Without blocks the
    activation knobs have nothing to choose: all chunk knobs set by hand leave nothing."""
    return None in (request.chunk_size, request.n_persist, request.n_buffer) or (
        num_blocks > 0 and activations_searchable(request)
    )


def model_state_bytes(
    plan: Plan, element_size: int, param_sizes: Sequence[tuple[int, bool]], *, optimizer_states: int
) -> int:
    """Device bytes of the plan's model state on rank 0, as the cost model counts them
    (``profiler.cost_model.persistent_chunk_bytes``): its persistent chunks and the buffers
    the others pass through. ``param_sizes``: (numel, trainable) in first-use order;
    ``optimizer_states``: the optimizer rule's fp32 state tensors per parameter."""
    packing = pack(param_sizes, plan.chunk_size // element_size, plan.world_size)
    persistent = sum(
        persistent_chunk_bytes(
            chunk,
            chunk_numel=packing.chunk_numel,
            world_size=plan.world_size,
            element_size=element_size,
            optimizer_states=optimizer_states,
        )
        for chunk in packing.chunks[: plan.n_persist]
    )
    return persistent + plan.n_buffer * packing.chunk_numel * element_size


def fit_host_with_nvme(plan: Plan, planning: PlanningSettings, param_sizes: Sequence[tuple[int, bool]]) -> Plan:
    """A rule's plan (not searched) with ``n_optimizer: auto`` and a path: the fewest chunks'
    state on NVMe that bring its host memory within the budget, counted as ``check_supported``
    counts it (none where it fits already, or where even all of them do not help)."""
    if plan.predicted_peak_host_bytes is not None or planning.request.n_optimizer is not None:
        return plan
    element_size = compute_element_size(planning.precision)
    packing = pack(param_sizes, plan.chunk_size // element_size, plan.world_size)
    offloaded = [(chunk.used, chunk.trainable) for chunk in packing.chunks[plan.n_persist :]]
    room = plan.host_budget_bytes - plan.host_fixed_bytes
    for n_nvme in range(sum(trainable for _, trainable in offloaded) + 1):
        regions = offloaded_region_bytes(
            offloaded,
            packing.chunk_numel // plan.world_size,
            element_size=element_size,
            keeps_gradients=plan.update_mode.keeps_gradients,
            optimizer_states=planning.optimizer_states,
            n_nvme=n_nvme,
        )
        if regions <= room:
            return plan if n_nvme == 0 else dataclasses.replace(plan, n_optimizer=n_nvme)
    return plan


def check_supported(plan: Plan, planning: PlanningSettings, param_sizes: Sequence[tuple[int, bool]]) -> None:
    """Refuse, before any training step, model state that cannot fit the device budget, and a
    rule's plan (made without a profile, so not checked by the search) whose host memory does not
    fit the host budget."""
    element_size = compute_element_size(planning.precision)
    states = planning.optimizer_states
    needed = model_state_bytes(plan, element_size, param_sizes, optimizer_states=states)
    if needed > plan.device_budget_bytes:
        raise SpecError(
            f"memory.device_budget: the model state of this plan needs {needed / 2**20:.1f} MiB per rank "
            f"(n_persist={plan.n_persist}, n_buffer={plan.n_buffer} chunks of "
            f"{plan.chunk_size / 2**20:.2f} MiB) but the budget is "
            f"{plan.device_budget_bytes / 2**20:.1f} MiB; raise the budget, or lower memory.n_persist"
        )
    if plan.predicted_peak_host_bytes is not None:
        return  # the search checked it
    packing = pack(param_sizes, plan.chunk_size // element_size, plan.world_size)
    offloaded = [(chunk.used, chunk.trainable) for chunk in packing.chunks[plan.n_persist :]]
    shard = packing.chunk_numel // plan.world_size
    regions = offloaded_region_bytes(
        offloaded,
        shard,
        element_size=element_size,
        keeps_gradients=plan.update_mode.keeps_gradients,
        optimizer_states=states,
        n_nvme=plan.n_optimizer,
    )
    host = regions + plan.host_fixed_bytes
    if host > plan.host_budget_bytes:
        raise SpecError(
            f"memory.host_budget: this plan holds {host / 2**30:.2f} GiB of host memory per rank "
            f"({regions / 2**30:.2f} GiB of offloaded model state and staging, "
            f"{plan.host_fixed_bytes / 2**30:.2f} GiB outside it: the process at start (the interpreter, "
            "torch, what the caller holds besides the model's parameters) and an async save's staging) "
            "but the budget is "
            f"{plan.host_budget_bytes / 2**30:.2f} GiB; raise memory.host_budget, use more ranks, build the "
            "model on the meta device and pass weights=, or set checkpoint.async_save: false"
        )


def refuse_impossible_knobs(
    model: nn.Module,
    settings: PlanningSettings,
    params: tuple[ParamInfo, ...],
    owned: list[list[int]],
    *,
    world_size: int,
) -> None:
    """Hand-set chunk knobs that no plan can honour, at any budget, are refused before profiling
    (which would be wasted), naming the smallest value of each hand-set knob that works.
    ``owned``: ``module_params(model, params)``."""
    request = settings.request
    element_size = compute_element_size(settings.precision)
    largest = max(params, key=lambda info: info.numel)
    if request.chunk_size is not None and largest.numel * element_size > request.chunk_size:
        raise SpecError(
            f"memory.chunk_size={request.chunk_size} is too small: parameter {largest.name} takes "
            f"{largest.numel * element_size:,} bytes in {settings.precision.value} and a parameter is "
            f"never split across chunks; the smallest chunk_size that works is "
            f"{spec_size(largest.numel * element_size)} (set at least that, or auto)"
        )
    sizes = [(info.numel, info.trainable) for info in params]
    if request.chunk_size is not None:
        chunk_sizes = [request.chunk_size]
    else:  # the sizes the search tries
        chunk_sizes = search_chunk_bytes(sizes, element_size, world_size)
    conflict = chunk_knob_conflict(
        sizes,
        owned,
        element_size=element_size,
        world_size=world_size,
        chunk_sizes=chunk_sizes,
        chunk_size_hand_set=request.chunk_size is not None,
        n_persist=request.n_persist,
        n_buffer=request.n_buffer,
        # The same modules, in the same order, as module_params lists.
        module_names=[name for name, _ in model.named_modules()],
    )
    if conflict is not None:
        raise SpecError(conflict)


def execution_order(model: nn.Module, example_batch: Any, device: DeviceInfo) -> list[str] | None:
    """Parameter names in first-use order from a no-grad forward on ``example_batch`` (module
    order when there is none), on stand-ins for parameters away from the device (a model held
    in host memory on a GPU: it is never moved whole). The forward's random draws (dropout) are
    undone: recording the order is not a training step, and another engine may be drawing too."""
    if example_batch is None:
        return None
    away = contextlib.nullcontext() if held_on(model, device.device) else stand_ins(model, device.device)
    with torch.random.fork_rng(devices=[device.device.index or 0] if device.is_cuda else []), away:
        return first_use_order(model, lambda: call_model(model, example_batch))

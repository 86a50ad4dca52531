"""Making the plan: the spec's knobs, filled where they say "auto".

With an example batch and a model held whole, the model and the machine are profiled
(runtime/probes.py), the measurements agreed across ranks, and the profiler's search picks the
fastest plan that fits (predictions included). Otherwise the resident rule keeps every chunk on
the device, or, when the model state alone exceeds the device budget, offloads every chunk
(conservative); the engine then profiles through its chunks on a batch (the example batch, or
the first training batch) and switches to the searched plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from profiler.chunking import candidate_chunk_bytes
from profiler.feasibility import chunk_knob_conflict, spec_size
from profiler.plan import BlockMode, Plan
from profiler.plan_builder import (
    KnobRequest,
    activations_searchable,
    block_modes_for,
    resident_plan,
    searched_plan,
)
from profiler.profile import HardwareProfile, ModelProfile, cache_key
from profiler.search import NoPlanFitsError
from runtime.blocks import BlocksNotFoundError, find_blocks
from runtime.chunks.layout import ParamInfo
from runtime.device import DeviceInfo, release_free_memory
from runtime.distributed import DistContext, all_reduce_max, all_reduce_sum_
from runtime.model_cache import cache_configs, caches_off
from runtime.probes import (
    ChunkedRun,
    ProfileOrigin,
    agree_model,
    hardware_key,
    hardware_profile,
    profile_model,
    read_agreed,
    with_disk_rates,
    write_cached,
)
from runtime.spec import AUTO, MemorySpec, Precision, Spec, auto_fields
from runtime.spec_io import SpecError


def make_plan(
    model: nn.Module,
    spec: Spec,
    *,
    params: tuple[ParamInfo, ...],
    world_size: int,
    budgets: tuple[int, int],
    example_batch: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: DeviceInfo | None = None,
    dist_ctx: DistContext | None = None,
    replanner: list[Callable[[int], Plan]] | None = None,
    first_batch: list[Callable[[Any, ChunkedRun | None], Plan | None]] | None = None,
    origin: ProfileOrigin | None = None,
) -> Plan:
    """Fill the spec's "auto" memory knobs. ``budgets``: (device, host) bytes per rank, already
    resolved from "auto" and agreed across ranks. ``example_batch`` (on the model's device) and
    ``device`` enable profiling and the search; ``dist_ctx`` None means a dry run (one process).
    ``replanner``, when given, receives the search over the same profiles at another device
    budget (only when the plan came from a search): what a re-plan runs. ``first_batch``, when
    given and the model was not profiled whole (no ``example_batch``, or its profiling step did
    not fit), receives the profile-and-search the engine runs through its chunks on a batch (the
    plan returned meanwhile is the resident or conservative rule's). ``origin``, when given,
    receives the profile cache entries each profiling read (the plan check drops stale ones)."""
    memory = spec.memory

    block_path, blocks = model_blocks(model, memory)
    chosen = tuple(path for path in auto_fields(spec) if path.startswith("memory."))
    element_size = compute_element_size(spec.precision)
    largest = max(params, key=lambda info: info.numel)
    if memory.chunk_size != AUTO and largest.numel * element_size > int(memory.chunk_size):
        raise SpecError(
            f"memory.chunk_size={memory.chunk_size} is too small: parameter {largest.name} takes "
            f"{largest.numel * element_size:,} bytes in {spec.precision.value} and a parameter is never "
            f"split across chunks; the smallest chunk_size that works is "
            f"{spec_size(largest.numel * element_size)} (set at least that, or auto)"
        )
    request = knob_request(memory)
    module_params = _module_params(model, params)
    _refuse_impossible_chunk_knobs(model, request, params, module_params, element_size, world_size)
    searchable = is_searchable(request, num_blocks=len(blocks))

    def profile_and_search(batch: Any, chunked: ChunkedRun | None = None) -> Plan | None:
        """Profile on ``batch`` (through the chunk engine when ``chunked``), search; None when
        the profiling step does not fit the device."""
        assert device is not None
        profiled = _profile(
            _Subject(model, spec, params, module_params, block_path, blocks, loss_fn, device),
            batch,
            dist_ctx,
            world_size,
            ssd_path=_ssd_path(request, len(blocks), memory),
            chunked=chunked,
            origin=origin,
        )
        if profiled is None:
            return None

        def search_at(device_budget: int) -> Plan:
            plan, _ = searched_plan(
                request=request,
                model=profiled[0],
                hardware=profiled[1],
                num_blocks=len(blocks),
                micro_batch_size=spec.micro_batch_size,
                device_budget_bytes=device_budget,
                host_budget_bytes=budgets[1],
                chosen=chosen,
                undo_snapshots=bool(spec.gradient_clipping),
                ssd_available=profiled[1].ssd_write_bytes_per_s > 0 and memory.ssd.path is not None,
            )
            return plan

        if replanner is not None:
            replanner.append(search_at)
        return search_at(budgets[0])

    try:
        if searchable and example_batch is not None and device is not None:
            searched = profile_and_search(example_batch)
            if searched is not None:
                return searched
        if searchable and device is not None and dist_ctx is not None and first_batch is not None:
            # Not profiled whole (no example batch, or the model did not fit): the engine
            # profiles through its chunks on a batch and switches to the searched plan (see
            # Engine.plan_on_batch); until then the rule below holds.
            def from_first_batch(batch: Any, chunked: ChunkedRun | None) -> Plan | None:
                try:
                    return profile_and_search(batch, chunked)
                except NoPlanFitsError as err:
                    raise SpecError(f"memory: {err}") from None

            first_batch.append(from_first_batch)
        plan = _resident(
            request, params, element_size, len(blocks), world_size, spec, budgets, chosen, module_params
        )
        if request.n_persist is None and model_state_bytes(plan, element_size) > budgets[0]:
            conservative = KnobRequest(**{**_fields(request), "n_persist": 0})
            plan = _resident(
                conservative,
                params,
                element_size,
                len(blocks),
                world_size,
                spec,
                budgets,
                chosen,
                module_params,
            )
            plan = _with_rule(
                plan,
                "conservative: the model state does not fit the device budget, so every chunk is offloaded",
            )
        return plan
    except NoPlanFitsError as err:
        raise SpecError(f"memory: {err}") from None
    except ValueError as err:
        raise SpecError(str(err)) from None


def _refuse_impossible_chunk_knobs(
    model: nn.Module,
    request: KnobRequest,
    params: tuple[ParamInfo, ...],
    module_params: list[list[int]],
    element_size: int,
    world_size: int,
) -> None:
    """Hand-set chunk knobs that no plan can honour, at any budget, are refused before profiling
    (which would be wasted), naming the smallest value of each hand-set knob that works."""
    sizes = [(info.numel, info.trainable) for info in params]
    if request.chunk_size is not None:
        chunk_sizes = [request.chunk_size]
    else:  # the sizes the search tries
        numels = [numel for numel, _ in sizes]
        chunk_sizes = candidate_chunk_bytes(sum(numels) * element_size, max(numels) * element_size)
    conflict = chunk_knob_conflict(
        sizes,
        module_params,
        element_size=element_size,
        world_size=world_size,
        chunk_sizes=chunk_sizes,
        chunk_size_hand_set=request.chunk_size is not None,
        n_persist=request.n_persist,
        n_buffer=request.n_buffer,
        # The same modules, in the same order, as _module_params lists.
        module_names=[name for name, _ in model.named_modules()],
    )
    if conflict is not None:
        raise SpecError(conflict)


def knob_request(memory: MemorySpec) -> KnobRequest:
    """The spec's memory knobs: a number where set by hand, None where "auto"."""

    def knob(value: int | str) -> int | None:
        return None if value == AUTO else int(value)

    return KnobRequest(
        chunk_size=knob(memory.chunk_size),
        n_persist=knob(memory.n_persist),
        n_buffer=knob(memory.n_buffer),
        n_swap=knob(memory.n_swap),
        n_checkpoint=knob(memory.n_checkpoint),
        n_offload=knob(memory.ssd.n_offload),
        block_modes=memory.block_modes,
    )


def is_searchable(request: KnobRequest, *, num_blocks: int) -> bool:
    """Whether any knob is left to the search (and so a profile is wanted). Without blocks the
    activation knobs have nothing to choose: all chunk knobs set by hand leave nothing."""
    return None in (request.chunk_size, request.n_persist, request.n_buffer) or (
        num_blocks > 0 and activations_searchable(request)
    )


def _resident(
    request: KnobRequest,
    params: tuple[ParamInfo, ...],
    element_size: int,
    num_blocks: int,
    world_size: int,
    spec: Spec,
    budgets: tuple[int, int],
    chosen: tuple[str, ...],
    module_params: list[list[int]],
) -> Plan:
    return resident_plan(
        request=request,
        param_sizes=[(p.numel, p.trainable) for p in params],
        element_size=element_size,
        num_blocks=num_blocks,
        world_size=world_size,
        micro_batch_size=spec.micro_batch_size,
        precision=spec.precision.value,
        device_budget_bytes=budgets[0],
        host_budget_bytes=budgets[1],
        chosen=chosen,
        module_params=module_params,
    )


def _fields(request: KnobRequest) -> dict[str, Any]:
    return {name: getattr(request, name) for name in KnobRequest.__dataclass_fields__}


def _with_rule(plan: Plan, rule: str) -> Plan:
    return Plan.from_dict({**plan.to_dict(), "rule": rule})


def model_state_bytes(plan: Plan, element_size: int) -> int:
    """Device bytes of the plan's model state: persistent chunks (full compute copy + fp32
    master, gradient and two Adam moments of the shard) and the buffers the others pass through."""
    chunk_numel = plan.chunk_size // element_size
    shard_numel = -(-chunk_numel // plan.world_size)
    needed = plan.n_persist * (chunk_numel * element_size + shard_numel * 16)
    return needed + plan.n_buffer * chunk_numel * element_size


@dataclass(frozen=True, slots=True)
class _Subject:
    """What is profiled, and how: passed from ``make_plan`` through ``_profile`` to ``_measure``."""

    model: nn.Module
    spec: Spec
    params: tuple[ParamInfo, ...]
    module_params: list[list[int]]
    block_path: str
    blocks: list[nn.Module]
    loss_fn: Callable[[Any], torch.Tensor] | None
    device: DeviceInfo


def _profile(
    subject: _Subject,
    example_batch: Any,
    dist_ctx: DistContext | None,
    world_size: int,
    *,
    ssd_path: Path | None,
    chunked: ChunkedRun | None = None,
    origin: ProfileOrigin | None = None,
) -> tuple[ModelProfile, HardwareProfile] | None:
    """(model profile, hardware profile), agreed across ranks; None when the profiling step
    does not fit the device (every rank then plans without a profile). The model profile is
    cached by the model's structure, the batch shape, precision, world size and machine; the
    cache entries read are noted in ``origin`` (started over)."""
    model, spec, params, device = subject.model, subject.spec, subject.params, subject.device
    autocast = _AUTOCAST.get(spec.precision)
    configs = cache_configs(model)

    def run_forward() -> Any:
        # Profiled as trained: without the model's key/value cache (see runtime.model_cache).
        with caches_off(configs):
            if autocast is None:
                return call_model(model, example_batch)
            with torch.autocast(device_type=device.autocast_type, dtype=autocast):
                return call_model(model, example_batch)

    cache_dir = Path(spec.profiler.cache_dir).expanduser()
    shape = batch_shape(example_batch)
    key = cache_key(
        [(p.name, p.shape, p.trainable) for p in params],
        [type(module).__name__ for module in model.modules()],
        subject.block_path,
        shape,
        spec.precision.value,
        world_size,
        hardware_key(device, world_size),
    )
    path = cache_dir / f"model-{key}.json"
    origin = origin if origin is not None else ProfileOrigin()
    origin.cached.clear()
    profile = read_agreed(path, ModelProfile.from_dict, dist_ctx)
    if profile is not None:
        origin.cached.append(path)
    else:
        profile = _measure(
            subject,
            run_forward,
            shape,
            chunked,
            agree_max=lambda seconds: seconds if dist_ctx is None else all_reduce_max(seconds, dist_ctx),
        )
        failed = torch.tensor([1.0 if profile is None else 0.0], dtype=torch.float64)
        if dist_ctx is not None:
            all_reduce_sum_(failed, dist_ctx)
        if failed.item() > 0 or profile is None:
            return None
        if dist_ctx is not None:
            profile = agree_model(profile, dist_ctx)
            write_cached(path, profile.to_dict())
    hardware = hardware_profile(device, dist_ctx, world_size=world_size, cache_dir=cache_dir, origin=origin)
    if ssd_path is not None:
        try:
            hardware = with_disk_rates(hardware, ssd_path, dist_ctx)
        except OSError as err:  # unwritable, full, or not a directory: say which, not a traceback
            raise SpecError(f"memory.ssd.path: cannot measure the disk under {ssd_path}: {err}") from None
    return profile, hardware


def _ssd_path(request: KnobRequest, num_blocks: int, memory: MemorySpec) -> Path | None:
    """The activation directory when the plan puts blocks on disk or may (``ssd.n_offload`` left
    to the search): its disk's rates are then measured."""
    if memory.ssd.path is None:
        return None
    may_search = activations_searchable(request) and request.n_offload is None
    if not may_search and BlockMode.SSD not in block_modes_for(request, num_blocks):
        return None
    return Path(memory.ssd.path).expanduser()


def _measure(
    subject: _Subject,
    run_forward: Callable[[], Any],
    shape: tuple[int, ...],
    chunked: ChunkedRun | None,
    *,
    agree_max: Callable[[float], float],
) -> ModelProfile | None:
    """The profiling steps; None when they do not fit the device. ``agree_max``: every rank's
    largest figure (the ranks stop profiling after the same step)."""
    spec = subject.spec
    try:
        return profile_model(
            subject.model,
            run_forward,
            loss_fn=subject.loss_fn or default_loss,
            params=subject.params,
            blocks=subject.blocks,
            block_path=subject.block_path,
            module_params=subject.module_params,
            batch_shape=shape,
            precision=spec.precision.value,
            element_size=compute_element_size(spec.precision),
            device=subject.device,
            warmup_steps=spec.profiler.warmup_steps,
            profile_steps=spec.profiler.profile_steps,
            chunked=chunked,
            agree_max=agree_max,
        )
    except torch.OutOfMemoryError:
        if chunked is None:  # the chunk engine clears its own (see ChunkManager.profiling)
            for param in subject.model.parameters():
                param.grad = None
        return None
    finally:
        release_free_memory(subject.device)


_AUTOCAST = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, else ``model(batch)``."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class LossNotFoundError(ValueError):
    """The model's output carries no loss to profile with (and no ``loss_fn`` says where)."""


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss``, or the output itself when it is a scalar tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise LossNotFoundError(
            "cannot find the loss in the model's output for profiling: return it as output.loss or "
            "a scalar, or pass initialize(..., loss_fn=lambda output: ...)"
        )
    return loss


def batch_shape(batch: Any) -> tuple[int, ...]:
    """Shape of the batch's main input: ``input_ids`` if present, else its first tensor."""
    if isinstance(batch, dict):
        first = batch.get("input_ids")
        candidates = [first] if first is not None else list(batch.values())
    elif isinstance(batch, (tuple, list)):
        candidates = list(batch)
    else:
        candidates = [batch]
    for candidate in candidates:
        if isinstance(candidate, torch.Tensor):
            return tuple(candidate.shape)
    return ()


def _module_params(model: nn.Module, params: tuple[ParamInfo, ...]) -> list[list[int]]:
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


COMPUTE_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
}


def compute_element_size(precision: Precision) -> int:
    """Bytes per element of the chunked compute copy of the parameters."""
    return 4 if precision is Precision.FP32 else 2


def model_blocks(model: nn.Module, memory: MemorySpec) -> tuple[str, list[nn.Module]]:
    """The model's block list (path and blocks). A model with no recognisable block list gets
    none when nothing asks for per-block activation modes (they then simply stay resident)."""
    blocks_path = None if memory.blocks == AUTO else str(memory.blocks)
    wants_modes = memory.block_modes is not None or any(
        value not in (AUTO, 0) for value in (memory.n_swap, memory.n_checkpoint, memory.ssd.n_offload)
    )
    try:
        return find_blocks(model, blocks_path)
    except BlocksNotFoundError as err:
        if blocks_path is not None or wants_modes:
            raise SpecError(str(err)) from None
        return "", []

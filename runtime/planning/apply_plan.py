"""``apply_plan(model, plan)``: a Plan carried out on a model, as its two managers.

- the chunk manager (``runtime.chunks``): model state in chunks of the plan's size, the first
  ``n_persist`` on the device, the others passing through ``n_buffer`` device buffers;
- the activation manager (``runtime.activations``): the plan's mode for each block, with this
  rank's activation file store when blocks go to disk.

``initialize`` applies the first plan (values from the model's parameters, or streamed from the
weights); a plan switch (``Engine.switch_plan``) applies the next one over the same parameters,
the training state then moved over from the old chunks in memory (``runtime.planning.plan_switch``). Policy
applied to mechanism by one plain function, as torchtitan's ``apply_fsdp`` and ``apply_ac`` do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from protrain.profiler.plan import BlockMode, Plan, UpdateMode
from protrain.profiler.search import MEMORY_MARGIN
from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.activations.ssd_store import ActivationFileStore, SsdIoError
from protrain.runtime.chunks.grad_buffers import gradient_buffer_count
from protrain.runtime.chunks.layout import ParamInfo, layout_from_params
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.config.settings import PlanningSettings, TrainingSettings
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.distributed import DistContext
from protrain.runtime.model_io.weights import WeightReader
from protrain.runtime.optim.registry import rule_named
from protrain.runtime.optim.rule import OptimizerHyper
from protrain.runtime.param_groups import resolve_param_hyper
from protrain.runtime.planning.disk_room import disk_neighbours
from protrain.runtime.planning.model_facts import COMPUTE_DTYPES, compute_element_size, model_blocks
from protrain.runtime.planning.plan_switch import HeldState, move_state


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanTarget:
    """What every plan of one engine is applied to: the model's parameters in first-use order,
    the settings, the device and the engine's process group."""

    params: tuple[ParamInfo, ...]
    training: TrainingSettings
    planning: PlanningSettings
    device: DeviceInfo
    dist_ctx: DistContext


def apply_plan(
    model: nn.Module,
    plan: Plan,
    *,
    target: PlanTarget,
    weights: WeightReader | None = None,
    state_from: HeldState | None = None,
) -> tuple[ChunkManager, ActivationManager]:
    """The chunk and activation managers that carry out ``plan`` on ``model``. Parameter values
    come from the model's parameters, from ``weights`` (a model built on the meta device), or
    from ``state_from``: another plan's state over the same parameters, held on the host
    (``plan_switch.hold_on_host``), whose parameters, moments and step counts move into the new
    layout (every rank calls it then; the caller closed the old managers first, the activation
    manager too: the new one may reuse its file directory)."""
    if state_from is not None:
        read_param: Callable[[str], torch.Tensor] | None = _zeros(target.params)
    else:
        read_param = None if weights is None else weights.get
    chunks = _build_chunks(model, plan, target, read_param)
    if state_from is not None:
        move_state(state_from, chunks, target.dist_ctx)
    return chunks, _build_activations(model, plan, chunks, target)


def _zeros(params: tuple[ParamInfo, ...]) -> Callable[[str], torch.Tensor]:
    """Zeros of each parameter's shape: the chunks of a plan switch are built empty, their
    values then moved in from the old layout (the parameters themselves are chunk views)."""
    shapes = {info.name: tuple(info.shape) for info in params}
    return lambda name: torch.zeros(shapes[name])


def _build_chunks(
    model: nn.Module,
    plan: Plan,
    target: PlanTarget,
    read_param: Callable[[str], torch.Tensor] | None,
) -> ChunkManager:
    settings = target.training
    element_size = compute_element_size(settings.precision)
    layout = layout_from_params(target.params, chunk_numel=plan.chunk_size // element_size, world_size=plan.world_size)
    assert layout.num_chunks == plan.num_chunks, "the plan and the layout pack the same parameters"
    optimizer = settings.optimizer
    hyper = resolve_param_hyper(model, [(info.name, *info.aliases) for info in target.params], optimizer)
    try:
        chunks = ChunkManager(
            model=model,
            layout=layout,
            n_persist=plan.n_persist,
            n_buffer=plan.n_buffer,
            n_replicate=plan.n_replicate,
            n_optimizer=plan.n_optimizer,
            nvme_root=target.planning.ssd_path,
            nvme_beside=disk_neighbours(
                plan, target.planning, [(p.numel, p.trainable) for p in target.params], element_size
            ),
            compute_dtype=COMPUTE_DTYPES[settings.precision],
            device=target.device,
            dist_ctx=target.dist_ctx,
            optimizer=rule_named(optimizer.type).for_momentum(optimizer.momentum),
            hyper=OptimizerHyper(
                weight_decay=hyper.weight_decay,
                group=hyper.group_of_param,
                lrs=hyper.lrs,
                betas=hyper.betas,
                eps=optimizer.eps,
                momentum=optimizer.momentum,
                dampening=optimizer.dampening,
                nesterov=optimizer.nesterov,
            ),
            read_param=read_param,
            update_mode=checked_update_mode(plan.update_mode, settings),
            gradient_buffers=gradient_buffer_count(
                budget_bytes=plan.device_budget_bytes,
                peak_bytes=plan.predicted_peak_device_bytes,
                chunk_bytes=plan.chunk_size,
                margin=MEMORY_MARGIN,
            ),
        )
    except ValueError as err:
        raise SpecError(str(err)) from None
    except SsdIoError as err:  # the NVMe tier's files: the directory, a full disk
        raise SpecError(f"memory.ssd.path: {err}") from None
    return chunks


def checked_update_mode(mode: UpdateMode, settings: TrainingSettings) -> UpdateMode:
    """``mode`` unless the job's settings rule it out: an update that needs the global norm
    (clipping, fp16) cannot be made early, and a window that keeps its gradients (those, or
    accumulation) cannot apply them on arrival."""
    needs_norm = settings.gradient_clipping > 0 or settings.loss_scale is not None
    if needs_norm and not mode.updates_after_norm:
        raise ValueError(f"update_mode {mode.value}: clipping and fp16 updates wait for the gradient norm")
    if settings.keeps_gradients and not mode.keeps_gradients:
        raise ValueError(f"update_mode {mode.value}: this job's windows keep their gradients until the step")
    return mode


def _build_activations(model: nn.Module, plan: Plan, chunks: ChunkManager, target: PlanTarget) -> ActivationManager:
    """The saved-tensor dispatcher carrying out the plan's block modes (and, with ssd blocks,
    this rank's activation file store under memory.ssd.path)."""
    _, blocks = model_blocks(model, target.planning)
    store = None
    if BlockMode.SSD in plan.block_modes:
        ssd_path = target.planning.ssd_path
        assert ssd_path is not None, "the spec validator requires ssd.path for ssd blocks"
        try:
            store = ActivationFileStore(ssd_path, rank=target.dist_ctx.rank)
        except OSError as err:
            raise SpecError(f"memory.ssd.path: {err}") from None
        if target.dist_ctx.is_main:
            print(f"protrain: activation files under {store.run_dir} ({store.io_mode})", flush=True)
    return ActivationManager(
        blocks=blocks,
        modes=plan.block_modes,
        chunks=chunks,
        device=target.device,
        store=store,
        model_buffers=model.buffers(),
        expected_ssd_bytes=plan.predicted_ssd_bytes or 0,
    )

"""The Planner: from the spec's memory knobs to a Plan, filled where they say "auto".

``initialize`` builds one per engine (``build_planner``) from plain planning settings, after the
hand-set knobs no plan can honour are refused. Three questions, three methods:

- ``initial_plan(example_batch)``: with an example batch and a model held whole, the model and
  the machine are profiled, the measurements agreed across ranks, and the search picks the
  fastest plan that fits. Otherwise every chunk stays on the device, or all are offloaded when
  the model state alone exceeds the device budget; ``wants_batch`` then asks for a batch.
- ``plan_on(batch, chunked)``: profile on a batch through the chunk engine running under the
  plan in force (the example batch, or the first training batch), and search.
- ``search_at(device_budget)``: search the latest profiles again at another budget (a re-plan,
  ``runtime.planning.replanner``).

It keeps the profiles it searched (``profiles``) and their cache entries (``origin``); it
measures through ``Profilers`` (tests pass wrapped ones instead of patching a module).
"""

from __future__ import annotations

import dataclasses
import gc
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from protrain.profiler.chunking import min_buffers, pack, smallest_chunk_size
from protrain.profiler.host_bytes import checkpoint_staging_bytes
from protrain.profiler.plan import BlockMode, Plan, UpdateMode
from protrain.profiler.plan_builder import (
    KnobRequest,
    activations_searchable,
    block_modes_for,
    resident_plan,
    searched_plan,
)
from protrain.profiler.profile import HardwareProfile, ModelProfile, cache_key
from protrain.profiler.search import NoPlanFitsError
from protrain.runtime.chunks.layout import ParamInfo, first_use_order
from protrain.runtime.config.settings import PlanningSettings
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.data.batches import batch_shape, call_model, default_loss
from protrain.runtime.hw.device import DeviceInfo, counts_every_byte, release_free_memory
from protrain.runtime.hw.distributed import DistContext, all_reduce_max, all_reduce_sum_
from protrain.runtime.model_cache import cache_configs, caches_off
from protrain.runtime.planning.hardware_probes import disk_inputs, hardware_key, with_disk_rates
from protrain.runtime.planning.model_facts import (
    AUTOCAST_DTYPES,
    compute_element_size,
    fit_host_with_nvme,
    is_searchable,
    model_blocks,
    model_state_bytes,
    module_params,
    refuse_impossible_knobs,
)
from protrain.runtime.planning.model_profiling import ChunkedRun, agree_model
from protrain.runtime.planning.profile_cache import ProfileOrigin, read_agreed, write_cached
from protrain.runtime.planning.profilers import Profilers


@dataclass(frozen=True, slots=True)
class Profiles:
    """What a search reads: the model's profile and the machine's, agreed across ranks."""

    model: ModelProfile
    hardware: HardwareProfile


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanningSubject:
    """What is planned for: the model, its parameters in first-use order and the parameters each
    module owns, its blocks, the loss, where it runs and with how many ranks."""

    model: nn.Module
    params: tuple[ParamInfo, ...]
    owned: list[list[int]]
    block_path: str
    blocks: list[nn.Module]
    loss_fn: Callable[[Any], torch.Tensor] | None
    device: DeviceInfo
    world_size: int


def build_planner(
    model: nn.Module,
    settings: PlanningSettings,
    *,
    params: tuple[ParamInfo, ...],
    world_size: int,
    budgets: tuple[int, int],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    device: DeviceInfo,
    dist_ctx: DistContext | None,
    profilers: Profilers | None = None,
    host_baseline_bytes: int = 0,
    host_model_bytes: int = 0,
) -> Planner:
    """The Planner of one engine; hand-set chunk knobs no plan can honour raise ``SpecError``
    here, before any profiling. ``budgets``: (device, host) bytes per rank, already resolved from
    "auto" and agreed across ranks. ``dist_ctx`` None means a dry run (one process, no group).
    ``host_baseline_bytes``: what the process held when ``initialize`` began (the interpreter,
    torch, the caller's model); ``host_model_bytes`` of which the model's parameters in host
    memory, which the chunks take over."""
    block_path, blocks = model_blocks(model, settings)
    owned = module_params(model, params)
    refuse_impossible_knobs(model, settings, params, owned, world_size=world_size)
    subject = PlanningSubject(
        model=model,
        params=params,
        owned=owned,
        block_path=block_path,
        blocks=blocks,
        loss_fn=loss_fn,
        device=device,
        world_size=world_size,
    )
    return Planner(
        subject=subject,
        settings=settings,
        budgets=budgets,
        dist_ctx=dist_ctx,
        profilers=profilers or Profilers(),
        host_baseline_bytes=host_baseline_bytes,
        host_model_bytes=host_model_bytes,
    )


@dataclass(slots=True, kw_only=True)
class Planner:
    """Makes the plans of one engine; see the module docstring."""

    subject: PlanningSubject
    settings: PlanningSettings
    budgets: tuple[int, int]
    dist_ctx: DistContext | None
    profilers: Profilers = field(default_factory=Profilers)
    profiles: Profiles | None = None
    """The profiles the latest search read; None until one was searched."""
    origin: ProfileOrigin = field(default_factory=ProfileOrigin)
    """The cache entries ``profiles`` were read from (the plan check drops stale ones)."""
    batch_tried: bool = False
    """``plan_on`` ran (a batch is profiled through the chunk engine once, or twice)."""
    failure: str | None = None
    """Why the last profiling step did not fit the device (its out-of-memory error), if so."""
    host_baseline_bytes: int = 0
    """What the process held in host memory when ``initialize`` began."""
    host_model_bytes: int = 0
    """Of which the caller's parameters in host memory: the chunks take them over."""

    @property
    def update_mode(self) -> UpdateMode:
        """How the plans update offloaded chunks: the job's clipping, precision and accumulation
        on this device (``UpdateMode.of``)."""
        settings = self.settings
        return UpdateMode.of(
            keeps_gradients=settings.keeps_gradients,
            updates_after_norm=settings.updates_after_norm,
            host_beside_compute=self.subject.device.is_cuda,
        )

    @property
    def host_fixed_bytes(self) -> int:
        """Host memory every plan holds beside its own regions: the process at start less the
        parameters the chunks take over, and an async save's staging (``profiler.host_bytes``)."""
        staging = 0
        if self.settings.async_save:
            staging = checkpoint_staging_bytes(
                [(p.numel, p.trainable) for p in self.subject.params],
                element_size=compute_element_size(self.settings.precision),
                world_size=self.subject.world_size,
                optimizer_states=self.settings.optimizer_states,
            )
        return max(0, self.host_baseline_bytes - self.host_model_bytes) + staging

    @property
    def searchable(self) -> bool:
        """Whether any knob is left to the search (and so a profile is wanted)."""
        return is_searchable(self.settings.request, num_blocks=len(self.subject.blocks))

    @property
    def wants_batch(self) -> bool:
        """The plan in force is a rule's although knobs are left to the search: a batch should be
        profiled through the chunk engine (``plan_on``), once. Never in a dry run."""
        pending = self.searchable and self.profiles is None and not self.batch_tried
        return pending and self.dist_ctx is not None

    def initial_plan(self, example_batch: Any = None) -> Plan:
        """The searched plan when ``example_batch`` (on the model's device; None: the model may
        not be run whole) can be profiled, else the resident or conservative rule's."""
        try:
            if self.searchable and example_batch is not None:
                searched = self._profile_and_search(example_batch, None)
                if searched is not None:
                    return searched
            return self._rule_plan()
        except NoPlanFitsError as err:
            raise SpecError(f"memory: {err}") from None
        except ValueError as err:
            raise SpecError(str(err)) from None

    def plan_on(self, batch: Any, chunked: ChunkedRun) -> Plan | None:
        """Profile on ``batch`` through the chunk engine and search; None when the profiling step
        does not fit the device. A loss the profiler cannot find raises ``LossNotFoundError``."""
        self.batch_tried = True
        self.failure = None
        try:
            return self._profile_and_search(batch, chunked)
        except NoPlanFitsError as err:
            raise SpecError(f"memory: {err}") from None

    def offloaded_plan(self, plan: Plan) -> Plan | None:
        """Profiling on a batch did not fit beside ``plan``'s persistent chunks: the conservative
        rule's plan (every chunk offloaded, the fewest buffers) to profile under instead, and one
        more ``plan_on``; None when ``plan`` offloads every chunk already or ``n_persist`` was set
        by hand."""
        if plan.n_persist == 0 or self.settings.request.n_persist is not None:
            return None
        self.batch_tried = False
        return self._offloaded(
            "conservative: profiling on a batch did not fit beside the persistent chunks, so every chunk is offloaded"
        )

    def search_at(self, device_budget: int) -> Plan:
        """The latest profiles searched at ``device_budget``; ``ValueError`` when nothing fits
        or nothing was profiled."""
        if self.profiles is None:
            raise ValueError("the plan was not searched from a profile")
        settings = self.settings
        plan, _ = searched_plan(
            request=settings.request,
            model=self.profiles.model,
            hardware=self.profiles.hardware,
            num_blocks=len(self.subject.blocks),
            micro_batch_size=settings.micro_batch_size,
            device_budget_bytes=device_budget,
            host_budget_bytes=self.budgets[1],
            chosen=settings.chosen,
            **disk_inputs(settings, self.profiles.hardware),
            update_mode=self.update_mode,
            host_fixed_bytes=self.host_fixed_bytes,
            optimizer_states=settings.optimizer_states,
        )
        return plan

    # ---------------------------------------------------------------- rules

    def _rule_plan(self) -> Plan:
        """Every chunk resident; every chunk offloaded (conservative) when the model state alone
        exceeds the device budget and ``n_persist`` was left to the planner."""
        request = self.settings.request
        element_size = compute_element_size(self.settings.precision)
        plan = self._resident(request)
        sizes = [(p.numel, p.trainable) for p in self.subject.params]
        state = model_state_bytes(plan, element_size, sizes, optimizer_states=self.settings.optimizer_states)
        if request.n_persist is None and state > self.budgets[0]:
            rule = "conservative: the model state does not fit the device budget, so every chunk is offloaded"
            plan = self._offloaded(rule)
        return fit_host_with_nvme(plan, self.settings, sizes)

    def _offloaded(self, rule: str) -> Plan:
        """Every chunk offloaded through the fewest buffers, of the smallest chunk size the
        search would try (unless set by hand): the least model state a plan holds."""
        request = self.settings.request
        sizes = [(p.numel, p.trainable) for p in self.subject.params]
        element_size = compute_element_size(self.settings.precision)
        chunk_size = request.chunk_size or smallest_chunk_size(sizes, element_size)
        n_buffer = request.n_buffer
        if n_buffer is None:  # the fewest every module needs, no prefetch buffer
            packing = pack(sizes, max(1, chunk_size // element_size), self.subject.world_size)
            n_buffer = min_buffers(packing, self.subject.owned, 0)
        plan = self._resident(dataclasses.replace(request, n_persist=0, chunk_size=chunk_size, n_buffer=n_buffer))
        return Plan.from_dict({**plan.to_dict(), "rule": rule})

    def _resident(self, request: KnobRequest) -> Plan:
        subject, settings = self.subject, self.settings
        plan = resident_plan(
            request=request,
            param_sizes=[(p.numel, p.trainable) for p in subject.params],
            element_size=compute_element_size(settings.precision),
            num_blocks=len(subject.blocks),
            world_size=subject.world_size,
            micro_batch_size=settings.micro_batch_size,
            precision=settings.precision.value,
            device_budget_bytes=self.budgets[0],
            host_budget_bytes=self.budgets[1],
            chosen=settings.chosen,
            module_params=subject.owned,
            update_mode=self.update_mode,
        )
        return dataclasses.replace(plan, host_fixed_bytes=self.host_fixed_bytes)

    # ---------------------------------------------------------------- profiling

    def first_use_order(self, batch: Any) -> list[str]:
        """Parameter names in the order a forward on ``batch`` (as trained, without gradients)
        first uses them. Its random draws (dropout) are undone: it is not a training step."""
        device = self.subject.device
        with torch.random.fork_rng(devices=[device.device.index or 0] if device.is_cuda else []):
            return first_use_order(self.subject.model, self._forward(batch))

    def use_params(self, params: tuple[ParamInfo, ...]) -> None:
        """Plan for the same parameters in another order (``Replanner``: their order of use)."""
        subject = self.subject
        self.subject = dataclasses.replace(subject, params=params, owned=module_params(subject.model, params))

    def _forward(self, batch: Any) -> Callable[[], Any]:
        """A forward on ``batch`` as trained: in the precision's autocast, without the model's
        key/value cache (see runtime.model_cache)."""
        model, device = self.subject.model, self.subject.device
        autocast = AUTOCAST_DTYPES.get(self.settings.precision)
        configs = cache_configs(model)

        def run_forward() -> Any:
            with caches_off(configs):
                if autocast is None:
                    return call_model(model, batch)
                with torch.autocast(device_type=device.autocast_type, dtype=autocast):
                    return call_model(model, batch)

        return run_forward

    def _profile_and_search(self, batch: Any, chunked: ChunkedRun | None) -> Plan | None:
        profiles = self._profile(batch, chunked)
        if profiles is None:
            return None
        self.profiles = profiles
        return self.search_at(self.budgets[0])

    def _profile(self, batch: Any, chunked: ChunkedRun | None) -> Profiles | None:
        """The profiles, agreed across ranks; None when the profiling step does not fit the
        device (every rank then plans without a profile). The model profile is cached by the
        model's structure, the batch shape, precision, world size and machine; the cache entries
        read are noted in ``origin`` (started over)."""
        subject, settings, dist_ctx = self.subject, self.settings, self.dist_ctx
        shape = batch_shape(batch)
        path = settings.cache_dir / f"model-{self._cache_key(shape)}.json"
        self.origin.clear()
        # First: the workspaces a step makes then must not be counted as the model's memory.
        workspaces = self._library_workspaces()
        profile = read_agreed(path, ModelProfile.from_dict, dist_ctx)
        if profile is not None:
            self.origin.add(path)
        else:
            self.failure = None
            profile = self._measure(batch, shape, chunked)
            failed = torch.tensor([1.0 if profile is None else 0.0], dtype=torch.float64)
            if dist_ctx is not None:
                all_reduce_sum_(failed, dist_ctx)
            if failed.item() > 0 or profile is None:
                # Every rank acts on the failure alike (the next plans must match).
                self.failure = self.failure or "another rank's profiling step did not fit its device"
                return None
            if dist_ctx is not None:
                profile = agree_model(profile, dist_ctx)
                write_cached(path, profile.to_dict())
        hardware = self.profilers.hardware(
            subject.device,
            dist_ctx,
            world_size=subject.world_size,
            cache_dir=settings.cache_dir,
            origin=self.origin,
            device_budget=self.budgets[0],
            optimizer=settings.optimizer,
            momentum=settings.optimizer_momentum,
        )
        hardware = dataclasses.replace(hardware, library_workspace_bytes=workspaces)
        ssd_path = self._ssd_path()
        if ssd_path is not None:
            try:
                hardware = with_disk_rates(hardware, ssd_path, dist_ctx)
            except OSError as err:  # unwritable, full, or not a directory: say which, not a traceback
                raise SpecError(f"memory.ssd.path: cannot measure the disk under {ssd_path}: {err}") from None
        return Profiles(profile, hardware)

    def _library_workspaces(self) -> int:
        """The math libraries' device workspaces, the most of any rank (the plans must match)."""
        measured = self.profilers.library_workspaces(self.subject.device)
        return measured if self.dist_ctx is None else int(all_reduce_max(float(measured), self.dist_ctx))

    def _cache_key(self, shape: tuple[int, ...]) -> str:
        subject = self.subject
        return cache_key(
            [(p.name, p.shape, p.trainable) for p in subject.params],
            [type(module).__name__ for module in subject.model.modules()],
            subject.block_path,
            shape,
            self.settings.precision.value,
            subject.world_size,
            hardware_key(subject.device, subject.world_size),
        )

    def _ssd_path(self) -> Path | None:
        """The SSD directory when the plan puts blocks or optimizer state on disk or may
        (``ssd.n_offload`` or ``ssd.n_optimizer`` left to the search): its rates are measured."""
        request, ssd_path = self.settings.request, self.settings.ssd_path
        if ssd_path is None:
            return None
        may_search = (activations_searchable(request) and request.n_offload is None) or request.n_optimizer != 0
        if not may_search and BlockMode.SSD not in block_modes_for(request, len(self.subject.blocks)):
            return None
        return ssd_path

    def _measure(self, batch: Any, shape: tuple[int, ...], chunked: ChunkedRun | None) -> ModelProfile | None:
        """The profiling steps; None when they do not fit the device. Every rank's largest step
        time is agreed (the ranks stop profiling after the same step)."""
        subject, settings, dist_ctx = self.subject, self.settings, self.dist_ctx
        model, device = subject.model, subject.device
        run_forward = self._forward(batch)
        profile: ModelProfile | None = None
        try:
            profile = self.profilers.model(
                model,
                run_forward,
                loss_fn=subject.loss_fn or default_loss,
                params=subject.params,
                blocks=subject.blocks,
                block_path=subject.block_path,
                module_params=subject.owned,
                batch_shape=shape,
                precision=settings.precision.value,
                element_size=compute_element_size(settings.precision),
                device=device,
                warmup_steps=settings.warmup_steps,
                profile_steps=settings.profile_steps,
                chunked=chunked,
                agree_max=lambda seconds: seconds if dist_ctx is None else all_reduce_max(seconds, dist_ctx),
                # Through the chunk engine the device is tight: activations wait on the host (where
                # the readings tell the two apart; the CPU's heap alone holds both).
                offload_saved=chunked is not None and counts_every_byte(device),
            )
        except torch.OutOfMemoryError as err:
            if chunked is None:  # the chunk engine clears its own (see ChunkManager.profiling)
                for param in model.parameters():
                    param.grad = None
            self.failure = str(err).splitlines()[0] if str(err) else type(err).__name__
            # The error may outlive this block (autograd's engine keeps the error of a failed
            # backward): its frames let go of the step's output and loss, and so of the graph
            # with every activation it saved.
            traceback.clear_frames(err.__traceback__)
        finally:
            release_free_memory(device)
        if profile is None:
            gc.collect()  # what the failed step held, and any cycle through its traceback, goes now
        return profile

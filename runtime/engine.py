"""The Engine: what a training script drives, with DeepSpeed's micro-batch semantics.

    out = engine(**batch)          # forward of the wrapped model, under the plan's precision
    engine.backward(out.loss)      # loss / gradient_accumulation_steps (x loss scale) backward
    engine.step()                  # an optimizer update only at the window's last micro-batch

Model state lives in chunks (``runtime.chunks.manager``): gradients are reduce-scattered into
fp32 shards during backward. Activations follow the plan's per-block modes
(``runtime.activations.manager``, the one saved-tensor dispatcher). At the window's end the
engine decides the same on every rank whether the update is skipped (non-finite loss, fp16
overflow), clips the global norm, runs AdamW on the shards (parameters that got no gradient on
any rank are skipped, as ``torch.optim.AdamW`` skips them), refreshes the device copies and
reports one record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from profiler.plan import BlockMode, Plan
from runtime.activations.manager import ActivationManager
from runtime.checkpoint.checkpointer import Checkpointer
from runtime.checkpoint.store import Checkpoint, CheckpointError
from runtime.chunks.manager import ChunkManager, SavedAlias
from runtime.console import MetricsFile, ProgressReporter, StepRecord
from runtime.device import DeviceInfo, synchronize
from runtime.distributed import DistContext, all_reduce_max, all_reduce_sum_, broadcast_object, release
from runtime.live_engines import EngineClaim
from runtime.loss_scale import DynamicLossScaler
from runtime.memory_probe import PeakMemoryProbe
from runtime.model_cache import CACHE_OFF_NOTE, cache_configs, caches_off, refuse_cache_with_recompute
from runtime.plan_check import PlanCheck
from runtime.plan_check import describe as describe_plan_check
from runtime.plan_check import judge as judge_plan_check
from runtime.plan_switch import move_state
from runtime.planning import LossNotFoundError, batch_shape
from runtime.probes import ChunkedRun, ProfileOrigin
from runtime.sampler import ShardedSampler
from runtime.schedule import lr_factor
from runtime.settings import TrainingSettings
from runtime.spec import NonFiniteLossPolicy, Precision
from runtime.spec_io import SpecError
from runtime.stop import StopRequest, TrainingStopped

_AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


REPLAN_MARGIN = 0.10
"""A measured peak this much above the prediction makes the engine re-plan."""
MAX_REPLANS = 2


@dataclasses.dataclass(frozen=True, slots=True)
class Rebuild:
    """What ``initialize`` hands the engine to build another plan's managers."""

    chunks: Callable[[Plan], ChunkManager]
    activations: Callable[[Plan, ChunkManager], ActivationManager]


class NonFiniteLossError(FloatingPointError):
    """A non-finite loss under ``on_nonfinite_loss: raise``; raised on every rank alike."""


def _batch_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``input_ids`` if given, else the first integer tensor argument, else the first tensor (a
    batch passed as one mapping is looked into)."""
    if not kwargs and len(args) == 1 and isinstance(args[0], dict):
        return _batch_tensor((), args[0])
    candidates = [kwargs.get("input_ids"), *args, *kwargs.values()]
    tensors = [value for value in candidates if isinstance(value, torch.Tensor) and value.dim() >= 1]
    integer = [value for value in tensors if not value.is_floating_point()]
    return (integer or tensors or [None])[0]


def count_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Tokens in a batch: the elements of ``input_ids`` or of the first integer tensor argument."""
    tensor = _batch_tensor(args, kwargs)
    return 0 if tensor is None or tensor.is_floating_point() else tensor.numel()


def count_samples(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Samples in a batch: the leading dimension of its batch tensor."""
    tensor = _batch_tensor(args, kwargs)
    return 0 if tensor is None else int(tensor.shape[0])


class Engine:
    """Trains ``module`` under ``plan``; see the module docstring for the call protocol."""

    def __init__(
        self,
        *,
        module: nn.Module,
        plan: Plan,
        settings: TrainingSettings,
        dist_ctx: DistContext,
        device: DeviceInfo,
        reporter: ProgressReporter,
        metrics: MetricsFile | None,
        chunks: ChunkManager,
        activations: ActivationManager,
        checkpointer: Checkpointer,
        stop: StopRequest | None = None,
        claim: EngineClaim | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        rebuild: Rebuild | None = None,
        replan: Callable[[int], Plan] | None = None,
        plan_from_batch: Callable[[Any, ChunkedRun | None], Plan | None] | None = None,
        profile_origin: ProfileOrigin | None = None,
    ) -> None:
        """``rebuild`` makes the chunk and activation managers of another plan (for
        ``switch_plan``); ``replan(device_budget)`` searches again over the profiles the plan
        came from (None: the plan was not searched, so it is never re-planned);
        ``plan_from_batch(batch, chunked)`` profiles on a batch through the chunk engine and
        searches (when ``initialize`` could not profile the model whole: see ``plan_on_batch``);
        ``profile_origin``: the profile cache entries the plan came from (dropped when the plan
        check finds them stale)."""
        self.module = module
        self.plan = plan
        self.settings = settings
        self.dist_ctx = dist_ctx
        self.device_info = device
        self.loss_fn = loss_fn
        self._reporter = reporter
        self._metrics = metrics
        self.chunks = chunks
        self.activations = activations
        self.checkpointer = checkpointer
        self._stop = stop
        self._claim = claim
        self.loss_scaler = DynamicLossScaler(settings.loss_scale) if settings.loss_scale else None
        self.global_step = 0
        """Optimizer updates made (skipped updates do not count)."""
        self.skipped_steps = 0
        self.micro_step = 0
        self.samples_consumed = 0
        """Samples every rank trained on, summed over ranks and updates (skipped ones too)."""
        self.resumed_from: Path | None = None
        """The checkpoint this run continued from, if any."""
        self._sampler: ShardedSampler | None = None
        self._stop_done = False
        self._resumed_data_state: dict[str, Any] | None = None
        self._window_samples = 0
        self._window_start: float | None = None
        self._window_loss = torch.zeros((), dtype=torch.float64)
        self._window_nonfinite = torch.zeros((), dtype=torch.float64)
        self._window_tokens = 0
        self._closed = False
        self._torn: str | None = None
        """Why training cannot go on (a failed backward left early updates half applied)."""
        self._rebuild = rebuild
        self._replan = replan
        self._plan_from_batch = plan_from_batch
        self._profile_origin = profile_origin if profile_origin is not None else ProfileOrigin()
        self.replans = 0
        """Plans switched to because the measured peak exceeded the prediction."""
        self._plan_check = PlanCheck(plan, accumulation=settings.gradient_accumulation_steps)
        self._peak_probe = PeakMemoryProbe(module, device, static_device_bytes=chunks.device_state_bytes())
        self._cache_configs = cache_configs(module)
        self._cache_note_shown = False

    # ---------------------------------------------------------------- properties

    @property
    def device(self) -> torch.device:
        return self.device_info.device

    @property
    def rank(self) -> int:
        return self.dist_ctx.rank

    @property
    def world_size(self) -> int:
        return self.dist_ctx.world_size

    @property
    def micro_batch_size(self) -> int:
        return self.settings.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.settings.gradient_accumulation_steps

    @property
    def lr(self) -> float:
        """The learning rate of the next update."""
        return self.settings.optimizer.lr * lr_factor(self.global_step, self.settings.schedule)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` call will update the parameters."""
        return (self.micro_step + 1) % self.settings.gradient_accumulation_steps == 0

    # ---------------------------------------------------------------- the call protocol

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_if_torn()
        if self._plan_from_batch is not None and self.module.training and torch.is_grad_enabled():
            self.plan_on_batch(kwargs if kwargs else (args[0] if len(args) == 1 else args), asked=False)
        self._refuse_larger_batch(args, kwargs)
        training = self.module.training and torch.is_grad_enabled()
        if training:
            refuse_cache_with_recompute(kwargs, recomputes=BlockMode.CHECKPOINT in self.plan.block_modes)
            if self._window_start is None:
                self._window_start = time.perf_counter()
                if self._plan_check.measuring_peak:
                    self._peak_probe.start()
            self._window_tokens += count_tokens(args, kwargs)
            self._window_samples += count_samples(args, kwargs)
        self.activations.begin_forward()
        try:
            with (
                self._autocast(),
                self.activations.saved_tensor_hooks(),
                self._caches_off(training, note="use_cache" not in kwargs),
            ):
                return self.module(*args, **kwargs)
        finally:
            self.activations.end_forward()
            self.chunks.end_forward()

    def plan_on_batch(self, batch: Any, *, asked: bool = True) -> None:
        """Profile on ``batch`` and switch to the searched plan, once: ``initialize`` does so on
        its example batch when it could not profile the model whole (weights streamed into
        chunks), the first training forward does so when there was no example batch. The
        profiling steps run through the chunk engine under the plan in force (so a model state
        larger than the device is profiled too), every block kept, their gradients dropped and
        the random streams restored: no training happens. ``asked`` False (the first training
        batch, which nobody asked to profile with): an output without a loss keeps the plan."""
        planner, self._plan_from_batch = self._plan_from_batch, None
        if planner is None:
            return
        # Profiling steps are training steps: the module in training mode (each submodule's own
        # mode put back afterwards: a frozen part may be in eval mode on purpose), grad enabled.
        modes = [(module, module.training) for module in self.module.modules()]
        if not self.module.training:
            self.module.train()
        try:
            with torch.enable_grad(), self.chunks.profiling(), self.activations.suspended():
                plan = planner(batch, chunked_run(self.chunks))
        except LossNotFoundError as err:
            if asked:
                raise SpecError(str(err)) from None
            self.log(f"plan: {err}; keeping the plan")
            return
        finally:
            for module, training in modes:
                module.training = training
        if plan is None:
            self.log("plan: profiling on a batch did not fit the device; keeping the plan")
            return
        plan = dataclasses.replace(plan, rule=f"planned on a batch through the chunk engine: {plan.rule}")
        if (plan.chunk_size, plan.n_persist, plan.n_buffer, plan.block_modes) == (
            self.plan.chunk_size,
            self.plan.n_persist,
            self.plan.n_buffer,
            self.plan.block_modes,
        ):
            self._adopt(plan)  # the same knobs: keep the managers, take the predictions
            return
        self.switch_plan(plan)

    def _refuse_larger_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The plan's memory prediction holds for batches no larger than the profiled one."""
        planned = self.plan.batch_shape
        if not planned:
            return
        shape = batch_shape(kwargs if kwargs else args if len(args) != 1 else args[0])
        if len(shape) == len(planned) and any(got > limit for got, limit in zip(shape, planned, strict=True)):
            raise ValueError(
                f"a batch of shape {tuple(shape)} is larger than the {tuple(planned)} this plan was made "
                "for (its memory prediction would not hold); pass the largest batch the job uses as "
                "initialize(..., example_batch=...)"
            )

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale). If it
        raises, the accumulation window's gradients are dropped (see ``_abandon_window``)."""
        self._refuse_if_torn()
        if loss.dim() != 0:
            raise ValueError(f"backward expects a scalar loss, got shape {tuple(loss.shape)}")
        detached = loss.detach().to(torch.float64).cpu()
        self._window_loss += torch.nan_to_num(detached, nan=0.0, posinf=0.0, neginf=0.0)
        self._window_nonfinite += (~torch.isfinite(detached)).to(torch.float64)
        scaled = loss / self.settings.gradient_accumulation_steps
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        elif self.is_gradient_accumulation_boundary():
            # fp16 gradients are still scaled and often overflow: only fp32/bf16 speculate.
            self.chunks.begin_last_backward(
                lr=self.lr,
                local_nonfinite=bool(self._window_nonfinite > 0),
            )
        try:
            self.activations.begin_backward()
            try:
                # Recomputed blocks run here: they see the configs their forward saw.
                with self._caches_off(True, note=False):
                    scaled.backward()
            finally:
                self.activations.end_backward()
                # Reduce what unused parameters left incomplete, in the fixed order every rank uses.
                self.chunks.finish_backward()
        except BaseException:
            self._abandon_window()
            raise

    def _abandon_window(self) -> None:
        """A backward that failed (a full disk, a failed read, Ctrl-C) added part of a
        micro-batch to the window's gradients: a caller who catches the error and goes on must not
        train on them. The whole window is dropped (its earlier micro-batches too: they are the
        caller's to run again) and the next micro-batch starts a new window. Early CPU-Adam
        updates are undone when they kept a snapshot; without one (clipping off) they cannot be,
        and the engine refuses to go on until a checkpoint is loaded."""
        self.chunks.finish_speculation()
        if self.chunks.speculation_undoable():
            self.chunks.discard_speculation()
        else:
            self._torn = (
                f"a backward failed in update {self.global_step + 1} after some chunks had already been "
                "updated from it (early CPU-Adam updates keep no undo state when gradient clipping is "
                "off); the parameters are part-updated: load a checkpoint (engine.load_checkpoint) "
                "to go on"
            )
        self.chunks.zero_grad()
        self.micro_step -= self.micro_step % self.settings.gradient_accumulation_steps
        self._reset_window()
        self.log("backward failed: this accumulation window's gradients were dropped")

    def _refuse_if_torn(self) -> None:
        if self._torn is not None:
            raise RuntimeError(self._torn)

    def step(self) -> bool:
        """Count one micro-batch; at the accumulation boundary, update. Returns whether the
        parameters changed."""
        self._refuse_if_torn()
        self.micro_step += 1
        if self.micro_step % self.settings.gradient_accumulation_steps != 0:
            return False
        return self._finish_window()

    # ---------------------------------------------------------------- the update

    def _finish_window(self) -> bool:
        stop_local = 1.0 if self._stop is not None and self._stop.requested else 0.0
        extras = torch.tensor(
            [
                float(self._window_loss),
                float(self._window_nonfinite),
                float(self._window_tokens),
                float(self._window_samples),
                stop_local,
            ],
            dtype=torch.float64,
        )
        # One collective carries every rank's per-parameter gradient flags, the counters and the
        # stop flag (a stop signal that reached any rank stops every rank after this update).
        header = all_reduce_sum_(torch.cat([self.chunks.params_with_grad(), extras]), self.dist_ctx)
        active = header[: -len(extras)] > 0
        loss_sum, nonfinite, tokens, samples, stop = header[-len(extras) :].tolist()
        self.samples_consumed += int(samples)
        if self._sampler is not None:
            # The sampler hands out whole micro-batches: a window consumed accumulation x
            # world x micro_batch_size of its positions, however the batch was passed in.
            self._sampler.consume(self._sampler.step * self.settings.gradient_accumulation_steps)
        window_start = self._window_start or time.perf_counter()
        self._reset_window()
        losses_in_window = self.settings.gradient_accumulation_steps * self.dist_ctx.world_size
        skipped = nonfinite > 0
        if skipped:
            self.chunks.discard_speculation()
        if skipped and self.settings.on_nonfinite_loss is NonFiniteLossPolicy.RAISE:
            self.chunks.zero_grad()
            raise NonFiniteLossError(
                f"non-finite loss in {int(nonfinite)} of {losses_in_window} micro-batches of update "
                f"{self.global_step + 1}; set on_nonfinite_loss: skip to skip such updates"
            )
        grad_norm: float | None = None
        # The global norm costs a pass over every gradient: taken when clipping or the fp16
        # overflow check needs it (then also reported), as DeepSpeed does.
        if not skipped and (self.settings.gradient_clipping > 0 or self.loss_scaler is not None):
            grad_norm = self._unscale_and_clip()
            if self.loss_scaler is not None:
                overflow = not math.isfinite(grad_norm)
                self.loss_scaler.update(overflow=overflow)
                skipped = overflow
        lr = self.lr
        if skipped:
            self.skipped_steps += 1
        else:
            self.chunks.step(lr=lr, active=active)
            self.global_step += 1
        self.chunks.zero_grad()
        synchronize(self.device_info)
        elapsed = time.perf_counter() - window_start
        self._report(
            StepRecord(
                step=self.global_step + self.skipped_steps,
                loss=loss_sum / losses_in_window if not nonfinite else float("nan"),
                lr=lr,
                grad_norm=grad_norm,
                step_time_s=elapsed,
                tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
                skipped=skipped,
                loss_scale=None if self.loss_scaler is None else self.loss_scaler.scale,
            )
        )
        self._after_update(updated=not skipped, stop=stop > 0)
        return not skipped

    def _after_update(self, *, updated: bool, stop: bool) -> None:
        """A periodic checkpoint, or the stop a signal asked for (checkpoint, then exit)."""
        settings = self.checkpointer.settings
        if stop:
            # A rank the signal did not reach itself stops as Ctrl-C would have stopped it.
            signum = self._stop.signum if self._stop is not None and self._stop.signum else 2
            where = ""
            if settings.dir is not None:
                where = f"; checkpoint {self.save_checkpoint()}"
            self.log(f"stopped at update {self.global_step}{where}")
            self._stop_done = True
            self.close()
            raise TrainingStopped(128 + signum)
        if updated and settings.dir is not None and settings.interval_steps > 0:
            if self.global_step % settings.interval_steps == 0:
                self.save_checkpoint()

    def _unscale_and_clip(self) -> float:
        """The global gradient norm (after unscaling), clipping the shards when configured, with
        ``torch.nn.utils.clip_grad_norm_``'s coefficient."""
        if self.loss_scaler is not None:
            self.chunks.scale_grads_(1.0 / self.loss_scaler.scale)
        norm = self.chunks.grad_norm()
        clip = self.settings.gradient_clipping
        if clip > 0 and math.isfinite(norm):
            coefficient = clip / (norm + 1e-6)
            if coefficient < 1.0:
                # Updates made before the norm was known used unclipped gradients.
                self.chunks.discard_speculation()
                self.chunks.scale_grads_(coefficient)
        return norm

    def _reset_window(self) -> None:
        self._window_start = None
        self._window_loss = torch.zeros((), dtype=torch.float64)
        self._window_nonfinite = torch.zeros((), dtype=torch.float64)
        self._window_tokens = 0
        self._window_samples = 0

    def _report(self, record: StepRecord) -> None:
        self._reporter.update(record)
        if self._metrics is not None:
            self._metrics.write(record.to_json())
        check = (
            None if record.skipped else self._plan_check.observe(record.step_time_s, self._peak_probe.stop)
        )
        if check is not None:
            check = self._judge_profile(check)
            self._reporter.print(describe_plan_check(check))
            if self._metrics is not None:
                self._metrics.write(check)
            self._replan_if_over(check)

    def _judge_profile(self, check: dict[str, Any]) -> dict[str, Any]:
        """A step time far off the prediction of a plan made from cached profiles: they were
        measured at another moment; drop them, so the next launch measures again."""
        check = judge_plan_check(check, from_cache=bool(self._profile_origin.cached))
        if check["off"] and check["profile"] == "cached":
            check["dropped_profiles"] = [str(path) for path in self._profile_origin.drop()]
        return check

    # ---------------------------------------------------------------- re-planning

    def _replan_if_over(self, check: dict[str, Any]) -> None:
        """A measured peak above the prediction by more than ``REPLAN_MARGIN`` (on any rank)
        means the profile saw less than the run needs: search again with the budget shrunk by
        that ratio, and switch to the plan found, before the difference runs out of memory."""
        predicted = self.plan.predicted_peak_device_bytes
        if self._replan is None or predicted is None or "measured_peak_device_bytes" not in check:
            return
        measured = all_reduce_max(float(check["measured_peak_device_bytes"]), self.dist_ctx)
        if measured <= predicted * (1 + REPLAN_MARGIN) or self.replans >= MAX_REPLANS:
            return
        ratio = measured / predicted
        budget = int(self.plan.device_budget_bytes / ratio)
        reason = (
            f"measured peak {measured / 2**20:.1f} MiB is {ratio - 1:.0%} above the predicted "
            f"{predicted / 2**20:.1f} MiB"
        )
        try:
            plan = self._replan(budget)
        except ValueError as err:  # nothing fits the shrunk budget: say so, carry on
            searched_at = f"{budget / 2**20:.1f} MiB"
            self.log(f"re-plan: {reason}, but the search at {searched_at} failed ({err}); keeping the plan")
            return
        plan = dataclasses.replace(
            plan,
            device_budget_bytes=self.plan.device_budget_bytes,
            rule=f"re-planned ({reason}; searched at {budget / 2**20:.1f} MiB): {plan.rule}",
        )
        self.log(f"re-plan: {reason}; searching again at {budget / 2**20:.1f} MiB")
        self.switch_plan(plan)
        self.replans += 1

    def switch_plan(self, plan: Plan) -> None:
        """Carry on under ``plan``: the chunk and activation managers are rebuilt for it and
        every parameter, moment and step count moves into its chunk layout (in memory; see
        ``runtime.plan_switch``). Every rank calls it, between updates."""
        if self._rebuild is None:
            raise RuntimeError("this engine cannot switch plans (it was not built by runtime.initialize)")
        if self.micro_step % self.settings.gradient_accumulation_steps != 0:
            raise RuntimeError("switch_plan in the middle of an accumulation window")
        self.checkpointer.wait()
        old_chunks, old_activations = self.chunks, self.activations
        chunks = self._rebuild.chunks(plan)
        move_state(old_chunks, chunks, self.dist_ctx)
        # The old activation manager goes first: the new one may reuse its file directory.
        old_activations.close()
        old_chunks.close()
        self.chunks = chunks
        self.activations = self._rebuild.activations(plan, chunks)
        self.checkpointer.use(chunks)
        self._peak_probe = PeakMemoryProbe(
            self.module, self.device_info, static_device_bytes=chunks.device_state_bytes()
        )
        self._adopt(plan)

    def _adopt(self, plan: Plan) -> None:
        """``plan`` is the one in force: its checks start over; it is shown and recorded."""
        self.plan = plan
        self._plan_check = PlanCheck(plan, accumulation=self.settings.gradient_accumulation_steps)
        self._reporter.show_plan(plan)
        if self._metrics is not None:
            self._metrics.write({"event": "plan", "plan": plan.to_dict()})

    @contextlib.contextmanager
    def _caches_off(self, training: bool, *, note: bool) -> Iterator[None]:
        """Training runs without the model's key/value cache (see ``runtime.model_cache``);
        ``note``: say so, once, when that changes what the caller's forward does."""
        if not training:
            yield
            return
        with caches_off(self._cache_configs) as turned_off:
            if turned_off and note and not self._cache_note_shown:
                self._cache_note_shown = True
                self.log(CACHE_OFF_NOTE)
            yield

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        dtype = _AUTOCAST_DTYPES.get(self.settings.precision)
        if dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device_info.autocast_type, dtype=dtype):
            yield

    # ---------------------------------------------------------------- using the model

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        self.module.eval()
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision parameters (gathered from every rank's shard) and buffers, by the
        model's own names (a tied parameter under each of its names); detached copies."""
        params = self.chunks.full_parameters()
        result: dict[str, torch.Tensor] = {}
        for name, tensor in self.module.state_dict().items():
            result[name] = params[name] if name in params else tensor.detach().clone()
        return result

    # ---------------------------------------------------------------- checkpoints and data

    def data_sampler(self, num_samples: int, *, shuffle: bool = True) -> ShardedSampler:
        """A sampler over a dataset of ``num_samples`` for this rank (batch size
        ``micro_batch_size``) whose position is saved with every checkpoint and restored on
        resume, so a resumed run sees exactly the batches the uninterrupted run would have. Give
        the DataLoader a ``generator`` of its own, or use ``data_loader``."""
        if self._sampler is not None:
            raise RuntimeError("engine.data_sampler() was already called: one sampler per engine")
        sampler = ShardedSampler(
            num_samples,
            world_size=self.world_size,
            rank=self.rank,
            micro_batch_size=self.micro_batch_size,
            seed=self.settings.seed,
            shuffle=shuffle,
        )
        if self._resumed_data_state is not None:
            sampler.load_state_dict(self._resumed_data_state)
        self._sampler = sampler
        return sampler

    def data_loader(self, dataset: Dataset[Any], **loader_args: Any) -> DataLoader[Any]:
        """A ``DataLoader`` over ``dataset`` with this rank's resumable ``data_sampler`` and
        ``micro_batch_size``; other arguments (``num_workers``, ``collate_fn``...) pass through.
        It draws its worker seeds from a generator of its own: a plain DataLoader draws them from
        the global random stream each time it starts an epoch, so a resumed run, which starts
        one at a different step, would see different dropout masks than the uninterrupted run."""
        for taken in ("batch_size", "sampler", "shuffle", "batch_sampler"):
            if taken in loader_args:
                raise TypeError(f"data_loader sets {taken} itself (micro_batch_size and data_sampler)")
        sampler = self.data_sampler(len(dataset))  # type: ignore[arg-type]
        generator = loader_args.pop("generator", None) or torch.Generator().manual_seed(self.settings.seed)
        return DataLoader(
            dataset, batch_size=self.micro_batch_size, sampler=sampler, generator=generator, **loader_args
        )

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "samples_consumed": self.samples_consumed,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "data": None if self._sampler is None else self._sampler.state_dict(),
            "seed": self.settings.seed,
            "precision": self.settings.precision.value,
        }

    def save_checkpoint(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Save the training state as ``<directory>/step-<global_step>`` (default: the spec's
        ``checkpoint.dir``); every rank calls it, between updates. Returns the checkpoint's path
        (with ``async_save``, where it will be once written)."""
        root = Path(directory) if directory is not None else self.checkpointer.settings.dir
        if root is None:
            raise ValueError("save_checkpoint needs a directory: pass one or set checkpoint.dir")
        if self.micro_step % self.settings.gradient_accumulation_steps != 0:
            raise RuntimeError(
                "save_checkpoint in the middle of an accumulation window: call it after engine.step() "
                "has updated the parameters"
            )
        path = self.checkpointer.save(Path(root), step=self.global_step, trainer_state=self._trainer_state())
        background = " (being written in the background)" if self.checkpointer.settings.async_save else ""
        self.log(f"checkpoint {path}{background}")
        return path

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Continue from a checkpoint: ``path`` is one checkpoint directory or a checkpoint root
        (its latest complete checkpoint is taken). Parameters, Adam state, step counts, loss
        scale, random streams and data position are restored; the world size may differ."""
        return self._load(self.checkpointer.locate(Path(path)))

    def resume(self) -> Path | None:
        """What ``initialize`` does with ``checkpoint.resume``: auto loads the latest complete
        checkpoint in ``checkpoint.dir`` if there is one, a path loads that, never nothing."""
        settings = self.checkpointer.settings
        if settings.resume == "never":
            return None
        if settings.resume != "auto":
            return self.load_checkpoint(settings.resume)
        if settings.dir is None:
            return None
        found = self.checkpointer.latest(settings.dir)
        return None if found is None else self._load(found)

    def _load(self, checkpoint: Checkpoint) -> Path:
        if self.micro_step % self.settings.gradient_accumulation_steps != 0:
            raise RuntimeError("load_checkpoint in the middle of an accumulation window")
        manifest = self.checkpointer.load(checkpoint, log=self.log)
        self._torn = None  # every parameter and moment comes from the checkpoint again
        try:
            self.global_step = int(manifest["global_step"])
            self.skipped_steps = int(manifest["skipped_steps"])
            self.samples_consumed = int(manifest["samples_consumed"])
            scaler = manifest["loss_scaler"]
            data = manifest["data"]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{checkpoint.path}: manifest lacks {err}") from err
        if self.loss_scaler is not None and scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
        self._resumed_data_state = data
        if self._sampler is not None:
            if data is not None:
                self._sampler.load_state_dict(data)
        self.resumed_from = checkpoint.path
        self.log(f"resumed from {checkpoint.path} (update {self.global_step})")
        return checkpoint.path

    def export(
        self, path: str | os.PathLike[str], *, hf: bool = False, dtype: torch.dtype | None = None
    ) -> Path:
        """Write the trained weights for use without ProTrain (every rank calls it; rank 0
        writes): one consolidated safetensors file at ``path`` (tied weights stored once, see
        ``runtime.export``), or with ``hf=True`` a Hugging Face directory for a transformers
        model. ``dtype`` casts floating tensors (e.g. ``torch.bfloat16``); default fp32."""
        from runtime.export import export_hf, export_safetensors

        state = self.state_dict()  # a collective: every rank takes part in the gathers
        target = Path(path)
        failure: BaseException | None = None
        if self.dist_ctx.is_main:
            try:
                if hf:
                    export_hf(self.module, state, target, dtype=dtype)
                else:
                    export_safetensors(state, target, model=self.module, dtype=dtype)
            except Exception as err:
                failure = err
        # Every rank learns how rank 0 did (none returns before the file exists, none waits
        # forever on a rank 0 that failed), and fails alike.
        error = broadcast_object(
            None if failure is None else f"{type(failure).__name__}: {failure}", self.dist_ctx
        )
        if failure is not None:
            raise failure
        if error is not None:
            raise RuntimeError(f"export to {target} failed on rank 0: {error}")
        self.log(f"exported {'Hugging Face directory' if hf else 'safetensors'} {target}")
        return target

    def log(self, text: str) -> None:
        """Print on rank 0 only."""
        self._reporter.print(text)

    def close(self) -> None:
        """Stop the progress display, close the metrics file, leave the process group. A stop
        signal that came while no update was under way ends here: ``TrainingStopped``."""
        self._close()
        stop = self._stop
        if stop is not None and stop.signum is not None and not self._stop_done:
            self._stop_done = True
            self.log(f"stopped after update {self.global_step} ({signal.Signals(stop.signum).name})")
            raise TrainingStopped(128 + stop.signum)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._peak_probe.active:
            self._peak_probe.stop()  # its hooks leave the model
        if self._stop is not None:
            self._stop.uninstall()
        try:
            self.checkpointer.close()
        finally:
            self._close_components()

    def _close_components(self) -> None:
        try:
            self._reporter.close()
            if self._metrics is not None:
                self._metrics.close()
            self.activations.close()
            self.chunks.close()
        finally:
            # Whatever failed above, the group and the claims go: another engine of the process
            # may still be training and must be able to close (and claim) after this one.
            release(self.dist_ctx)
            if self._claim is not None:
                self._claim.release()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._close()  # the exception in flight is the news, not a pending stop


def chunked_run(chunks: ChunkManager) -> ChunkedRun:
    """The chunk engine's side of profiling steps run through it, inside ``chunks.profiling()``."""

    def pack(tensor: torch.Tensor) -> Any:
        alias = chunks.pack_alias(tensor)
        return tensor if alias is None else alias

    def unpack(packed: Any) -> torch.Tensor:
        return chunks.unpack_alias(packed) if isinstance(packed, SavedAlias) else packed

    return ChunkedRun(
        pack=pack,
        unpack=unpack,
        model_state=chunks.model_state_storages,
        stall_s=lambda: chunks.stall_s,
        end_forward=chunks.end_forward,
        end_step=chunks.drain,
    )

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
import signal
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from protrain.profiler.plan import BlockMode, Plan
from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.batches import refuse_larger_batch, to_device
from protrain.runtime.checkpoint.checkpointer import Checkpointer
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.config.settings import TrainingSettings
from protrain.runtime.console import MetricsFile, ProgressReporter, StepRecord
from protrain.runtime.hw.device import DeviceInfo, synchronize
from protrain.runtime.hw.distributed import DistContext
from protrain.runtime.loaders import DataPosition
from protrain.runtime.model_cache import TrainingCaches, refuse_cache_with_recompute
from protrain.runtime.planning.model_facts import AUTOCAST_DTYPES
from protrain.runtime.planning.replanner import Replanner
from protrain.runtime.tracing.trace_window import NO_TRACE, UpdateObserver
from protrain.runtime.training.engine_facades import EngineFacades, device_call
from protrain.runtime.training.live_engines import EngineClaim
from protrain.runtime.training.loss_scale import DynamicLossScaler
from protrain.runtime.training.parts import EngineParts, close_dropped
from protrain.runtime.training.reporting import UpdateReports
from protrain.runtime.training.stop import StopRequest, TrainingStopped
from protrain.runtime.training.update import sum_window, update_shards
from protrain.runtime.training.window import Window


class Engine(EngineFacades):
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
        replanner: Replanner | None = None,
        trace: UpdateObserver = NO_TRACE,
    ) -> None:
        """``replanner`` (from ``initialize``) is asked on a batch and after each window whether
        to switch plans, and applies the plan switched to; without one the plan never changes."""
        self.module = module
        self.plan = plan
        self.settings = settings
        self.dist_ctx = dist_ctx
        self.device_info = device
        self.loss_fn = loss_fn
        self._reporter = reporter
        self._parts = EngineParts(
            chunks=chunks, activations=activations, checkpointer=checkpointer, dist_ctx=dist_ctx, stop=stop, claim=claim
        )
        # Dropped without close(), the engine gives its parts back when it is collected.
        self._finalizer = weakref.finalize(self, close_dropped, self._parts)
        self._finalizer.atexit = False
        self._stop = stop
        self._claim = claim
        self._wall = None if claim is None else claim.wall
        if claim is not None:
            claim.hold_plan(plan.predicted_peak_device_bytes)
        self.loss_scaler = DynamicLossScaler(settings.loss_scale) if settings.loss_scale else None
        self.global_step = 0
        """Optimizer updates made (skipped updates do not count)."""
        self.skipped_steps = self.micro_step = 0
        self.samples_consumed = 0
        """Samples every rank trained on, summed over ranks and updates (skipped ones too)."""
        self.resumed_from: Path | None = None
        """The checkpoint this run continued from, if any."""
        self.data_position = DataPosition(dist_ctx, micro_batch_size=settings.micro_batch_size, seed=settings.seed)
        """This rank's resumable sampler (see ``data_sampler``), saved with checkpoints."""
        self._stop_done = False
        self._window = Window()
        self._window_steps, self._boundary, self._backward_closes, self._step_applied = 0, None, None, False
        self._torn: str | None = None
        """Why training cannot go on (a failed backward left early updates half applied)."""
        self._replanner = replanner
        self._trace = self._parts.trace = trace  # logging.trace (runtime/tracing/trace_window.py)
        self._reports = self._parts.reports = UpdateReports(
            module=module,
            device=device,
            reporter=reporter,
            metrics=metrics,
            plan=plan,
            settings=settings,
            static_device_bytes=chunks.device_state_bytes(),
            replanner=replanner,
            sources=self._parts,
        )
        self._caches = TrainingCaches(module, log=reporter.print)  # not self.log: no cycle

    # ---------------------------------------------------------------- properties

    @property
    def replans(self) -> int:
        """Plans switched to because the measured peak exceeded the prediction."""
        return 0 if self._replanner is None else self._replanner.replans

    # ---------------------------------------------------------------- the call protocol

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @device_call("forward")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_if_torn()
        args, kwargs = to_device((args, kwargs), self.device_info.device)  # where the chunks are
        if self._replanner is not None and self._replanner.wants_batch and self._training():
            self.plan_on_batch(kwargs if kwargs else (args[0] if len(args) == 1 else args), asked=False)
        refuse_larger_batch(self.plan.batch_shape, args, kwargs)
        if training := self._training():
            refuse_cache_with_recompute(kwargs, recomputes=BlockMode.CHECKPOINT in self.plan.block_modes)
            if self._window.start_s is None:
                self._window.start_s = time.perf_counter()  # this module's clock: tests replace it
                self._reports.window_started()
                self._trace.window_started(self)
            self._window.count_batch(args, kwargs)
        self.activations.begin_forward()
        try:
            with (
                self._autocast(),
                self.activations.saved_tensor_hooks(),
                self._caches.off(training, note="use_cache" not in kwargs),
                self._reports.forward(training),
            ):
                return self.module(*args, **kwargs)
        finally:
            self.activations.end_forward()
            self.chunks.end_forward()

    @device_call("plan_on_batch")
    def plan_on_batch(self, batch: Any, *, asked: bool = True) -> None:
        """Profile on ``batch`` and switch to the searched plan, once: ``initialize`` does so on
        its example batch when it could not profile the model whole (weights streamed into
        chunks), the first training forward does so when there was no example batch. The
        profiling steps run through the chunk engine under the plan in force (so a model state
        larger than the device is profiled too), every block kept, their gradients dropped and
        the random streams restored: no training happens. ``asked`` False (the first training
        batch, which nobody asked to profile with): an output without a loss keeps the plan."""
        if self._replanner is None:
            return
        plan = self._replanner.plan_on(batch, chunks=self.chunks, activations=self.activations, asked=asked)
        if plan is None and self._replanner.planner.failure is not None:  # the step did not fit
            self.switch_plan(self._replanner.did_not_fit(self.plan))
            plan = self._replanner.plan_on(batch, chunks=self.chunks, activations=self.activations, asked=asked)
            if plan is None and self._replanner.planner.failure is not None:
                self._replanner.did_not_fit(self.plan)  # raises: nothing smaller to profile under
        if plan is None:
            self._reports.reporter.show_deferred_plan(self.plan)
            return
        if not self._replanner.needs_switch(plan, self.plan):
            self._adopt(plan)  # the same knobs: keep the managers, take the predictions
        else:
            self.switch_plan(plan)

    def _training(self) -> bool:
        return self.module.training and torch.is_grad_enabled()

    @device_call("backward")
    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale);
        ``scale_wrt_gas=False``: of ``loss`` itself, which the caller normalised over the window
        (as a Trainer does), and the window's reported loss is then the sum of its losses. If it
        raises, the accumulation window's gradients are dropped (see ``_abandon_window``)."""
        self._refuse_if_torn()
        if loss.dim() != 0:
            raise ValueError(f"backward expects a scalar loss, got shape {tuple(loss.shape)}")
        closes = self.is_gradient_accumulation_boundary()
        if not closes and self.chunks.applies_on_arrival:
            raise RuntimeError(
                "this backward does not end its accumulation window, but the engine applies each "
                "gradient as it arrives (gradient_accumulation_steps 1, no clipping, not fp16): set "
                "gradient_accumulation_steps in the spec to the window's length"
            )
        self._window.add_loss(loss)
        self._window.normalised = not scale_wrt_gas
        scaled = loss / self.settings.gradient_accumulation_steps if scale_wrt_gas else loss
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        self._backward_closes = closes
        self._reports.backward_began()
        if self._backward_closes:
            # Early updates (unclipped fp32/bf16) or the two-phase norms: the chunks know which.
            self.chunks.begin_last_backward(lr=self.group_lrs, local_nonfinite=self._window.any_nonfinite)
        try:
            self.activations.begin_backward()
            try:
                # Recomputed blocks run here: they see the configs their forward saw.
                with self._caches.off(True, note=False):
                    scaled.backward()
            finally:
                self.activations.end_backward()
                # Reduce what unused parameters left incomplete, in the fixed order every rank uses.
                self.chunks.finish_backward()
                self._reports.backward_ended()
        except BaseException:
            self._abandon_window()
            raise

    def _abandon_window(self) -> None:
        """A backward that failed (a full disk, a failed read, Ctrl-C) added part of a
        micro-batch to the window's gradients: a caller who catches the error and goes on must not
        train on them. The whole window is dropped (its earlier micro-batches too: they are the
        caller's to run again) and the next micro-batch starts a new window. Early CPU-Adam
        updates (clipping off) keep no undo state: after one the engine refuses to go on until a
        checkpoint is loaded."""
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
        self.micro_step -= self._window_steps
        self._window, self._window_steps, self._backward_closes = Window(), 0, None
        self.log("backward failed: this accumulation window's gradients were dropped")

    def _refuse_if_torn(self) -> None:
        if self._torn is not None:
            raise RuntimeError(self._torn)

    @device_call("step")
    def step(self) -> bool:
        """Count one micro-batch; at the accumulation boundary, update. Returns whether the
        parameters changed."""
        self._refuse_if_torn()
        closes = self._closes_window()
        self.micro_step += 1
        self._window_steps += 1
        self._backward_closes = None
        return self._finish_window() if closes else False

    # ---------------------------------------------------------------- the update

    def _finish_window(self) -> bool:
        micro_batches, normalised = self._window_steps, self._window.normalised
        stop = self._stop is not None and self._stop.requested
        totals = sum_window(self._window, self.chunks, self.dist_ctx, stop=stop)
        self.samples_consumed += totals.samples
        self.data_position.consume_window(micro_batches)
        window_start = self._window.start_s or time.perf_counter()
        self._window, self._window_steps = Window(), 0
        losses_in_window = micro_batches * self.dist_ctx.world_size
        # A caller-normalised window's losses add up to its loss (one sum per rank to average).
        loss_divisor = self.dist_ctx.world_size if normalised else losses_in_window
        lr, group_lrs = self.lr, self.group_lrs
        updated, grad_norm = update_shards(
            totals,
            chunks=self.chunks,
            settings=self.settings,
            loss_scaler=self.loss_scaler,
            lr=group_lrs,
            update_number=self.global_step + 1,
            losses_in_window=losses_in_window,
        )
        self._step_applied, self._global_grad_norm = updated, grad_norm
        if updated:
            self.global_step += 1
        else:
            self.skipped_steps += 1
        self._lrs_updated()
        self._reports.update_queued()
        if self._trace is not NO_TRACE or self._reports.times_update(self.global_step + self.skipped_steps):
            synchronize(self.device_info)
        elapsed = time.perf_counter() - window_start
        self._trace.window_finished(self)
        self._report(
            StepRecord(
                step=self.global_step + self.skipped_steps,
                loss=float("nan") if totals.nonfinite else totals.loss_sum / loss_divisor,
                lr=lr,
                grad_norm=grad_norm,
                step_time_s=elapsed,
                tokens_per_s=totals.tokens / elapsed if elapsed > 0 else 0.0,
                skipped=not updated,
                loss_scale=None if self.loss_scaler is None else self.loss_scaler.scale,
                waits={**self.chunks.take_waits(), "activation_s": self.activations.take_wait_s()},
                tokens=totals.tokens,
                samples=totals.samples,
            )
        )
        self._after_update(updated=updated, stop=totals.stop)
        return updated

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

    def _report(self, record: StepRecord) -> None:
        plan = self._reports.report(record, plan=self.plan, dist_ctx=self.dist_ctx)
        if plan is not None:
            self.switch_plan(plan)

    @device_call("switch_plan")
    def switch_plan(self, plan: Plan) -> None:
        """Carry on under ``plan``: the chunk and activation managers are rebuilt for it and
        every parameter, moment and step count moves into its chunk layout (in memory; see
        ``runtime.planning.plan_switch``). Every rank calls it, between updates."""
        if self._replanner is None:
            raise RuntimeError("this engine cannot switch plans (it was not built by runtime.initialize)")
        if self._window_steps != 0:
            raise RuntimeError("switch_plan in the middle of an accumulation window")
        self.checkpointer.wait()
        # The old activation manager goes first: the new one may reuse its file directory.
        self.activations.close()
        self._parts.chunks, self._parts.activations = self._replanner.apply(plan, state_from=self.chunks)
        self.checkpointer.use(self.chunks)
        self._adopt(plan, static_device_bytes=self.chunks.device_state_bytes())

    def _adopt(self, plan: Plan, *, static_device_bytes: int | None = None) -> None:
        """``plan`` is the one in force (see ``UpdateReports.adopt``)."""
        self.plan = plan
        if self._claim is not None:
            self._claim.hold_plan(plan.predicted_peak_device_bytes)
        self._reports.adopt(plan, static_device_bytes=static_device_bytes)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = AUTOCAST_DTYPES.get(self.settings.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_info.autocast_type, dtype=dtype)

    @device_call("close")
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
        self._finalizer.detach()
        self._parts.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._close()  # the exception in flight is the news, not a pending stop

"""The Engine: what a training script drives, with DeepSpeed's micro-batch semantics.

    out = engine(**batch)          # forward of the wrapped model, under the plan's precision
    engine.backward(out.loss)      # loss / gradient_accumulation_steps (x loss scale) backward
    engine.step()                  # an optimizer update only at the window's last micro-batch

The Engine is a composition over parts it owns: the training state (state.py: the chunk and
activation managers, the checkpointer, how far training has come), the accumulation window
(window.py), the plan's owner (runtime/planning/controller.py), the learning rates
(learning_rates.py), the checkpoint calls (checkpoints.py), the reports and the trace. At the
window's end every rank decides alike whether the update is skipped (update.py), runs it on the
shards and reports one record.
"""

from __future__ import annotations

import contextlib
import signal
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from protrain.profiler.plan import BlockMode, Plan
from protrain.runtime.activations.manager import ActivationManager
from protrain.runtime.checkpoint.checkpointer import Checkpointer
from protrain.runtime.chunks.gathered import gathered
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.config.settings import TrainingSettings
from protrain.runtime.data.batches import refuse_larger_batch, to_device
from protrain.runtime.data.loaders import DataPosition
from protrain.runtime.hw.device import DeviceInfo, synchronize
from protrain.runtime.model_cache import TrainingCaches, refuse_cache_with_recompute
from protrain.runtime.model_io.outputs import ModelOutputs
from protrain.runtime.observability.console import ProgressReporter
from protrain.runtime.observability.observer import Observers, UpdateObserver
from protrain.runtime.planning.controller import PlanController
from protrain.runtime.planning.model_facts import autocast
from protrain.runtime.training.checkpoints import TrainingCheckpoints
from protrain.runtime.training.delegation import Reads, delegate, device_call
from protrain.runtime.training.learning_rates import LearningRates
from protrain.runtime.training.loss_scale import DynamicLossScaler
from protrain.runtime.training.optimizer_facade import EngineOptimizer
from protrain.runtime.training.state import TrainingState, close_dropped
from protrain.runtime.training.stop import TrainingStopped
from protrain.runtime.training.update import abandon_window, close_window
from protrain.runtime.training.window import AccumulationWindow

_E = TypeVar("_E", bound="Engine")


class Engine:
    """Trains ``module`` under its plan; see the module docstring for the call protocol."""

    def __init__(
        self,
        *,
        state: TrainingState,
        settings: TrainingSettings,
        device: DeviceInfo,
        reporter: ProgressReporter,
        observers: Sequence[UpdateObserver],
        plans: PlanController,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wait_for_device: Callable[[DeviceInfo], None] = synchronize,
    ) -> None:
        """``state`` holds what it trains and owns; ``observers`` watch each window (the reports,
        the trace: runtime/observability/observer.py); ``plans`` owns the plan; ``clock`` times
        the updates and ``wait_for_device`` lets the device finish one whose time is read (tests
        give their own)."""
        self.module, self.settings, self.device_info, self.loss_fn = state.module, settings, device, loss_fn
        self.dist_ctx, self._state, self._plans = state.dist_ctx, state, plans
        self._observers = Observers(observers)
        self._reporter, self._clock, self._wait_for_device = reporter, clock, wait_for_device
        # Dropped without close(), the engine gives its state back when it is collected.
        self._finalizer = weakref.finalize(self, close_dropped, state)
        self._finalizer.atexit = False
        self._wall = None if state.claim is None else state.claim.wall
        self._window = AccumulationWindow(settings.gradient_accumulation_steps)
        self._rates = LearningRates(
            self.module,
            settings.optimizer,
            settings.schedule,
            updates_made=lambda: state.progress.global_step,
            step_applied=self.was_step_applied,
        )
        # The parts log through the reporter, not self.log: a part referring to the engine would
        # make it a cycle, which only the garbage collector frees (the finalizer runs late).
        log = reporter.print
        self._checkpoints = TrainingCheckpoints(state, self._window, settings, moved=self._rates.moved, log=log)
        self._outputs = ModelOutputs(self.module, state, self.dist_ctx, log=log)
        self._step_applied, self._stop_done = False, False
        self._grad_norm: float | None = None
        self._caches = TrainingCaches(self.module, log=log)

    # ---------------------------------------------------------------- what it holds, read where it is

    plan = Reads[Plan]("_plans.plan", "The plan in force.")
    chunks = Reads[ChunkManager]("_state.chunks", "The chunk manager of the plan in force.")
    activations = Reads[ActivationManager]("_state.activations", "The activation manager of the plan in force.")
    checkpointer = Reads[Checkpointer]("_state.checkpointer")
    replans = Reads[int]("_plans.replans", "Plans switched to because the measured peak exceeded the prediction.")
    global_step = Reads[int]("_state.progress.global_step", "Optimizer updates made (skipped ones do not count).")
    skipped_steps = Reads[int]("_state.progress.skipped_steps")
    micro_step = Reads[int]("_state.progress.micro_step")
    samples_consumed = Reads[int]("_state.progress.samples_consumed", "Samples trained on, all ranks and updates.")
    resumed_from = Reads[Path | None]("_state.progress.resumed_from", "The checkpoint this run continued from.")
    data_position = Reads[DataPosition]("_state.data_position")
    loss_scaler = Reads[DynamicLossScaler | None]("_state.loss_scaler", "fp16's dynamic loss scale.")
    device = Reads[torch.device]("device_info.device")
    rank = Reads[int]("dist_ctx.rank")
    world_size = Reads[int]("dist_ctx.world_size")
    micro_batch_size = Reads[int]("settings.micro_batch_size")
    gradient_accumulation_steps = Reads[int]("settings.gradient_accumulation_steps")
    group_lrs = Reads[tuple[float, ...]]("_rates.group_lrs", "Each optimizer group's rate for the next update.")
    optimizer = Reads[EngineOptimizer]("_rates.facade", "The optimizer as torch.optim code sees it.")

    @property
    def lr(self) -> float:
        """The learning rate of the next update (the top-level one; ``group_lrs`` has each)."""
        return self.group_lrs[0]

    @property
    def lr_from_optimizer(self) -> bool:
        """True: a scheduler of the caller's owns the rates in ``engine.optimizer``'s groups."""
        return self._rates.from_optimizer

    @lr_from_optimizer.setter
    def lr_from_optimizer(self, value: bool) -> None:
        self._rates.from_optimizer = value

    def log(self, text: str) -> None:
        """Print on rank 0 only."""
        self._reporter.print(text)

    # ---------------------------------------------------------------- the call protocol

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @device_call("forward")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_if_torn()
        args, kwargs = to_device((args, kwargs), self.device_info.device)  # where the chunks are
        if self._plans.wants_batch and self._training():
            self._plans.on_batch(kwargs if kwargs else (args[0] if len(args) == 1 else args), asked=False)
        refuse_larger_batch(self.plan.batch_shape, args, kwargs)
        if training := self._training():
            refuse_cache_with_recompute(kwargs, recomputes=BlockMode.CHECKPOINT in self.plan.block_modes)
            if self._window.totals.start_s is None:
                self._window.totals.start_s = self._clock()
                self._plans.window_started()
                self._observers.window_started(self)
            self._window.totals.count_batch(args, kwargs)
        self.activations.begin_forward()
        try:
            with (
                autocast(self.settings.precision, self.device_info),
                self.activations.saved_tensor_hooks(),
                self._caches.off(training, note="use_cache" not in kwargs),
                self._observers.forward(training),
            ):
                return self.module(*args, **kwargs)
        finally:
            self.activations.end_forward()
            self.chunks.end_forward()

    @device_call("plan_on_batch")
    def plan_on_batch(self, batch: Any, *, asked: bool = True) -> None:
        """Profile on ``batch`` through the chunk engine and switch to the searched plan, once
        (no training happens): for a model ``initialize`` could not profile whole."""
        self._plans.on_batch(to_device(batch, self.device_info.device), asked=asked)

    def _training(self) -> bool:
        return self.module.training and torch.is_grad_enabled()

    @device_call("backward")
    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale);
        ``scale_wrt_gas=False``: of ``loss`` itself, which the caller normalised over the window
        (as a Trainer does). If it raises, the window's gradients are dropped."""
        self._refuse_if_torn()
        if loss.dim() != 0:
            raise ValueError(f"backward expects a scalar loss, got shape {tuple(loss.shape)}")
        closes = self._window.is_gradient_accumulation_boundary()
        self._window.refuse_open_when_applied_on_arrival(closes, self.chunks.applies_on_arrival)
        self._window.totals.add_loss(loss)
        self._window.totals.normalised = not scale_wrt_gas
        scaled = loss / self.settings.gradient_accumulation_steps if scale_wrt_gas else loss
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        self._window.backward_closes = closes
        self._observers.backward_began()
        if closes:  # early updates (unclipped fp32/bf16) or the two-phase norms: the chunks know which
            self.chunks.begin_last_backward(lr=self.group_lrs, local_nonfinite=self._window.totals.any_nonfinite)
        try:
            self.activations.begin_backward()
            try:
                with self._caches.off(True, note=False):  # recomputed blocks see their forward's configs
                    scaled.backward()
            finally:
                self.activations.end_backward()
                self.chunks.finish_backward()  # what unused parameters left, in the fixed order
                self._observers.backward_ended()
        except BaseException:
            abandon_window(self._window, self._state)
            self.log("backward failed: this accumulation window's gradients were dropped")
            raise

    def _refuse_if_torn(self) -> None:
        if self._state.progress.torn is not None:
            raise RuntimeError(self._state.progress.torn)

    @device_call("step")
    def step(self) -> bool:
        """Count one micro-batch; at the window's end, update. Whether the parameters changed."""
        self._refuse_if_torn()
        closes = self._window.step_closes()
        self._state.progress.micro_step += 1
        if not closes:
            return False
        state, progress = self._state, self._state.progress
        stop = state.stop is not None and state.stop.requested
        outcome = close_window(self._window, state, self.settings, lrs=self.group_lrs, stop=stop, clock=self._clock)
        self._step_applied, self._grad_norm = outcome.updated, outcome.grad_norm
        self._rates.moved()
        self._observers.update_queued()
        if self._plans.measuring or self._observers.reads_update_time(progress.updates):
            self._wait_for_device(self.device_info)  # else the update's tail counts in the next one's time
        elapsed_s = self._clock() - outcome.started_s
        self._observers.window_finished(self)
        waits = {**self.chunks.take_waits(), "activation_s": self.activations.take_wait_s()}
        scale = None if state.loss_scaler is None else state.loss_scaler.scale
        record = outcome.record(step=progress.updates, elapsed_s=elapsed_s, loss_scale=scale, waits=waits)
        self._observers.update_reported(record, self.plan)
        if outcome.updated:
            self._plans.update_measured(elapsed_s)
        self._after_update(updated=outcome.updated, stop=outcome.totals.stop)
        return outcome.updated

    def _after_update(self, *, updated: bool, stop: bool) -> None:
        """A periodic checkpoint, or the stop a signal asked for (checkpoint, then exit)."""
        settings = self.checkpointer.settings
        if stop:
            # A rank the signal did not reach itself stops as Ctrl-C would have stopped it.
            signum = self._state.stop.signum if self._state.stop is not None and self._state.stop.signum else 2
            where = f"; checkpoint {self.save_checkpoint()}" if settings.dir is not None else ""
            self.log(f"stopped at update {self.global_step}{where}")
            self._stop_done = True
            self.close()
            raise TrainingStopped(128 + signum)
        if updated and self._checkpoints.due():
            self.save_checkpoint()

    @device_call("switch_plan")
    def switch_plan(self, plan: Plan) -> None:
        """Carry on under ``plan``, every value moved into its chunk layout (every rank, between
        updates; runtime/planning/controller.py)."""
        self._window.refuse_inside("switch_plan")
        self._plans.switch(plan)

    # ---------------------------------------------------------------- the parts' calls

    is_gradient_accumulation_boundary = delegate("_window", AccumulationWindow.is_gradient_accumulation_boundary)
    set_gradient_accumulation_boundary = delegate("_window", AccumulationWindow.set_gradient_accumulation_boundary)
    zero_grad = delegate("_window", AccumulationWindow.zero_grad)
    data_sampler = delegate("data_position", DataPosition.data_sampler)
    data_loader = delegate("data_position", DataPosition.data_loader)
    state_dict = delegate("_outputs", ModelOutputs.state_dict, wall="state_dict")
    export = delegate("_outputs", ModelOutputs.export, wall="export")
    save_pretrained = delegate("_outputs", ModelOutputs.save_pretrained, wall="save_pretrained")
    save_checkpoint = delegate("_checkpoints", TrainingCheckpoints.save_checkpoint, wall="save_checkpoint")
    load_checkpoint = delegate("_checkpoints", TrainingCheckpoints.load_checkpoint, wall="load_checkpoint")
    resume = delegate("_checkpoints", TrainingCheckpoints.resume, wall="resume")

    def was_step_applied(self) -> bool:
        """Whether the last update changed the parameters (False: skipped for a non-finite loss
        or an fp16 overflow, or no update yet), as DeepSpeed's ``was_step_applied``."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last update, before clipping (DeepSpeed's name),
        taken every update (it is logged); None before the first update and after one skipped
        for a non-finite loss."""
        return self._grad_norm

    def gathered(
        self, params: Iterable[nn.Parameter], *, modify: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """``with engine.gathered(model.lm_head.parameters()):`` the parameters hold their values
        on the device for the block, wherever it reads them (DeepSpeed's ``GatheredParameters``):
        for code that reads a weight outside the forward of the module that owns it, which is
        refused otherwise while its chunk is offloaded. ``modify=True`` keeps what the block
        wrote (rank 0's values) in the fp32 masters. Every rank enters it, in the same order."""
        return gathered(self.chunks, params, modify=modify)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters (chunk-managed: one not on the device may be empty)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse)

    def train(self: _E, mode: bool = True) -> _E:
        self.module.train(mode)
        return self

    def eval(self: _E) -> _E:
        self.module.eval()
        return self

    # ---------------------------------------------------------------- the end

    @device_call("close")
    def close(self) -> None:
        """Give everything back; a stop signal that came between updates ends here."""
        self._close()
        stop = self._state.stop
        if stop is not None and stop.signum is not None and not self._stop_done:
            self._stop_done = True
            self.log(f"stopped after update {self.global_step} ({signal.Signals(stop.signum).name})")
            raise TrainingStopped(128 + stop.signum)

    def _close(self) -> None:
        self._finalizer.detach()
        self._state.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._close()  # the exception in flight is the news, not a pending stop

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
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from profiler.plan import Plan
from runtime.activations.manager import ActivationManager
from runtime.chunks.manager import ChunkManager
from runtime.console import MetricsFile, ProgressReporter, StepRecord
from runtime.device import DeviceInfo, synchronize
from runtime.distributed import DistContext, all_reduce_sum_, destroy
from runtime.loss_scale import DynamicLossScaler
from runtime.plan_check import PlanCheck
from runtime.plan_check import describe as describe_plan_check
from runtime.planning import batch_shape
from runtime.schedule import lr_factor
from runtime.settings import TrainingSettings
from runtime.spec import NonFiniteLossPolicy, Precision

_AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


class NonFiniteLossError(FloatingPointError):
    """A non-finite loss under ``on_nonfinite_loss: raise``; raised on every rank alike."""


def count_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Tokens in a batch: ``input_ids`` if given, else the first integer tensor argument."""
    candidates = [kwargs.get("input_ids"), *args, *kwargs.values()]
    for value in candidates:
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim() >= 1:
            return value.numel()
    return 0


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
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
    ) -> None:
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
        self.loss_scaler = DynamicLossScaler(settings.loss_scale) if settings.loss_scale else None
        self.global_step = 0
        """Optimizer updates made (skipped updates do not count)."""
        self.skipped_steps = 0
        self.micro_step = 0
        self._window_start: float | None = None
        self._window_loss = torch.zeros((), dtype=torch.float64)
        self._window_nonfinite = torch.zeros((), dtype=torch.float64)
        self._window_tokens = 0
        self._closed = False
        self._plan_check = PlanCheck(plan, accumulation=settings.gradient_accumulation_steps)

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
        self._refuse_larger_batch(args, kwargs)
        if self.module.training and torch.is_grad_enabled():
            if self._window_start is None:
                self._window_start = time.perf_counter()
            self._window_tokens += count_tokens(args, kwargs)
        self.activations.begin_forward()
        try:
            with self._autocast(), self.activations.saved_tensor_hooks():
                return self.module(*args, **kwargs)
        finally:
            self.activations.end_forward()
            self.chunks.end_forward()

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
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale)."""
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
        self.activations.begin_backward()
        try:
            scaled.backward()
        finally:
            self.activations.end_backward()
            # Reduce what unused parameters left incomplete, in the fixed order every rank uses.
            self.chunks.finish_backward()

    def step(self) -> bool:
        """Count one micro-batch; at the accumulation boundary, update. Returns whether the
        parameters changed."""
        self.micro_step += 1
        if self.micro_step % self.settings.gradient_accumulation_steps != 0:
            return False
        return self._finish_window()

    # ---------------------------------------------------------------- the update

    def _finish_window(self) -> bool:
        tokens_local = float(self._window_tokens)
        extras = torch.stack(
            [self._window_loss, self._window_nonfinite, torch.tensor(tokens_local, dtype=torch.float64)]
        )
        # One collective carries every rank's per-parameter gradient flags and the counters.
        header = all_reduce_sum_(torch.cat([self.chunks.params_with_grad(), extras]), self.dist_ctx)
        active = header[: -len(extras)] > 0
        loss_sum, nonfinite, tokens = header[-len(extras) :].tolist()
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
        return not skipped

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

    def _report(self, record: StepRecord) -> None:
        self._reporter.update(record)
        if self._metrics is not None:
            self._metrics.write(record.to_json())
        check = None if record.skipped else self._plan_check.observe(record.step_time_s)
        if check is not None:
            self._reporter.print(describe_plan_check(check))
            if self._metrics is not None:
                self._metrics.write(check)

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

    def log(self, text: str) -> None:
        """Print on rank 0 only."""
        self._reporter.print(text)

    def close(self) -> None:
        """Stop the progress display, close the metrics file, leave the process group."""
        if self._closed:
            return
        self._closed = True
        self._reporter.close()
        if self._metrics is not None:
            self._metrics.close()
        self.activations.close()
        self.chunks.close()
        destroy(self.dist_ctx)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

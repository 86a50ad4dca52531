"""Hugging Face ``Trainer`` on the ProTrain engine: ``ProTrainTrainer`` and ``ProTrainMixin``.

    trainer = ProTrainTrainer(model=model, args=TrainingArguments(...), train_dataset=train,
                              eval_dataset=evaluation, protrain="job.yaml")
    trainer.train()                       # or train(resume_from_checkpoint=True)
    trainer.save_model("out")             # consolidated weights: from_pretrained("out")
    trainer.end()

    class MySFT(ProTrainMixin, SFTTrainer): ...   # any trainer built on Trainer

The Trainer's loop runs as it is; the mixin replaces its seams (transformers 5.x):

- ``create_accelerator_and_postprocess``: the spec and the TrainingArguments are reconciled
  first (``runtime.integrations.hf_spec``: one value per setting, a disagreement refused naming
  both) and clashing options refused (``hf_checks``); the Accelerator gets no mixed precision
  (the engine owns autocast and fp16 loss scaling);
- ``_move_model_to_device`` moves nothing: the engine places each chunk;
- ``create_optimizer`` builds the engine (``runtime.initialize``, the Trainer's decay/no-decay
  split as the spec's groups; the first batch profiles and plans when the spec does not fix the
  memory knobs) and returns its optimizer facade, whose learning rates the Trainer's scheduler
  writes: the scheduler stays the one owner of the learning rate;
- ``_wrap_model`` returns the engine (no DDP: the engine reduces gradients itself);
- ``training_step`` tells the engine whether this micro-batch ends the window (the Trainer's
  ``sync_gradients``: an epoch's last window can be short), runs the Trainer's own step with its
  backward going to ``engine.backward(loss, scale_wrt_gas=False)`` (the Trainer normalised the
  loss already), then ``engine.step()``, which updates at the window's end as DeepSpeed's engine
  does; the Trainer's ``optimizer.step()`` that follows does nothing, and a skipped update holds
  the scheduler (``step_was_skipped``);
- clipping and the reported gradient norm are the engine's (``gradient_clipping`` =
  ``max_grad_norm``);
- ``save_model`` (and so every checkpoint) streams the weights out of the chunks on every rank
  (``engine.save_pretrained``: Trainer's ``_save`` returns early on non-writers, which would
  leave the others in the gathers) and rank 0 writes them as ``save_pretrained`` would (a PEFT
  model its adapter), with the processing class and the training arguments beside them;
- checkpoints: ``checkpoint-N`` holds the engine's checkpoint under ``protrain/`` beside the
  Trainer's files; resuming loads it once the engine exists, so the run continues exactly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import enable_full_determinism, set_seed

from protrain import runtime
from protrain.runtime.config.job import launched_dry_run
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.integrations.fused_head import gather_head_after_backbone
from protrain.runtime.integrations.hf_checks import refuse_clashing_args, refuse_own_optimizer
from protrain.runtime.integrations.hf_spec import (
    Reconciled,
    SpecSource,
    reconcile,
    user_spec,
    with_args,
    with_decay_groups,
)
from protrain.runtime.model_io.weights import WeightsSource
from protrain.runtime.training.engine import Engine
from protrain.runtime.training.optimizer_facade import EngineOptimizer
from protrain.runtime.training.schedule import build_scheduler

ENGINE_CHECKPOINT = "protrain"
"""The engine's checkpoint inside a Trainer's ``checkpoint-N`` folder."""
OPTIMIZER_FILE, SCHEDULER_FILE = "optimizer.pt", "scheduler.pt"  # the Trainer's names


class ProTrainMixin:
    """The seams above, for any class built on ``transformers.Trainer`` (put it first)."""

    # What the mixin reads of Trainer (declared for type checkers; Trainer sets them).
    args: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    accelerator: Any

    def __init__(
        self,
        *args: Any,
        protrain: SpecSource = None,
        example_batch: Any = None,
        weights: WeightsSource | None = None,
        **kwargs: Any,
    ) -> None:
        """``protrain``: the job spec (a path, a dict of spec keys or a ``Spec``); None takes
        protrain-run's spec when it launched this process, else the defaults. ``example_batch``:
        a batch of the largest shape the run will see (batches of varying length: one padded to
        the longest), which the engine plans for up front; without it the plan is made for the
        first training batch, and a longer one later is refused. ``weights``: for a ``model``
        built on the meta device (``accelerate.init_empty_weights()`` or ``torch.device("meta")``
        around ``from_config``), where its values come from: a directory of safetensors files (what
        ``save_pretrained`` wrote), a state dict or a callable, read one parameter at a time into
        its chunk, so the model is never whole in host memory (``from_pretrained`` loads it whole on
        every rank). Every other argument is the Trainer's."""
        self._protrain_source = protrain
        self._example_batch = example_batch
        self._weights = weights
        self._protrain: Reconciled | None = None
        self._engine: Engine | None = None
        self._head_hooks: list[Any] = []
        self._ended = False
        super().__init__(*args, **kwargs)
        # Trainer.__init__ takes its loader's batch size off the caller's arguments, after the seam
        # below replaced self.args: a micro_batch_size set in the spec only must reach the loader.
        self._train_batch_size = self.args.train_batch_size
        refuse_own_optimizer(self)

    @property
    def protrain_engine(self) -> Engine | None:
        """The engine training the model (None until training, evaluation or saving needs it)."""
        return self._engine

    # ---------------------------------------------------------------- construction

    def create_accelerator_and_postprocess(self) -> None:
        # The first seam Trainer.__init__ calls with self.args set: settle the arguments here, so
        # that everything the Trainer builds after (accelerator, loaders, schedule) follows them.
        refuse_clashing_args(self.args)
        reconciled = reconcile(user_spec(self._protrain_source), self.args)
        seed = self.args.seed
        self.args = with_args(self.args, reconciled.args_updates)
        if self.args.seed != seed:  # Trainer seeded with the old value a moment ago
            enable_full_determinism(self.args.seed) if self.args.full_determinism else set_seed(self.args.seed)
        self._protrain = reconciled
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        if launched_dry_run() is not None and self.model is not None:
            # protrain-run --dry-run: plan and print now, and end, before the Trainer makes its
            # output folder or a loader.
            self._protrain_engine()

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        accelerator_args = super()._build_accelerator_args(**kwargs)  # type: ignore[misc]
        accelerator_args["mixed_precision"] = "no"  # the engine autocasts and scales fp16 losses
        return accelerator_args

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """Nothing: the engine moves the buffers and places each parameter chunk by chunk."""

    # ---------------------------------------------------------------- the engine

    def _protrain_engine(self) -> Engine:
        """The engine, built on first need over ``self.model``."""
        if self._engine is not None:
            return self._engine
        self._refuse_if_ended()
        assert self._protrain is not None, "set up in create_accelerator_and_postprocess"
        model = self.model
        decay = set(self.get_decay_parameter_names(model))  # type: ignore[attr-defined]
        exempt = [name for name, p in model.named_parameters() if p.requires_grad and name not in decay]
        spec = with_decay_groups(self._protrain.spec, exempt)
        # The Trainer seeded the random streams; building the engine (which reseeds) leaves them so.
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            engine = runtime.initialize(model, config=spec, example_batch=self._example_batch, weights=self._weights)
        engine.lr_from_optimizer = True
        # TRL's fused loss reads the head's weight outside the head's forward.
        self._head_hooks = gather_head_after_backbone(model, engine)
        self._engine = engine
        return engine

    def create_optimizer(self, model: torch.nn.Module | None = None) -> EngineOptimizer:
        optimizer = self._protrain_engine().optimizer
        # Accelerate hands back an optimizer marked prepared as it is: wrapped, the facade's
        # step_was_skipped (which holds the scheduler after a skipped update) would be hidden.
        optimizer._is_accelerate_prepared = True  # type: ignore[attr-defined]
        self.optimizer = optimizer
        return optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's scheduler for its arguments, or the spec's schedule when the spec sets one."""
        assert self._protrain is not None
        if self._protrain.spec_schedule and self.lr_scheduler is None:
            schedule = self._protrain_engine().settings.schedule
            self.lr_scheduler = build_scheduler(optimizer or self.optimizer, schedule)
            self._created_lr_scheduler = True  # Trainer rebuilds it on the next train() call
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)  # type: ignore[misc]

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> Engine:
        return self._protrain_engine()

    # ---------------------------------------------------------------- a training step

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        engine = self._protrain_engine()
        engine.set_gradient_accumulation_boundary(bool(self.accelerator.sync_gradients))
        with _backward_through(self.accelerator, engine):
            loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        engine.step()
        return loss

    def _clip_grad_norm(self, model: Any) -> float | None:
        """The engine clipped at the window's end (to ``max_grad_norm``); its norm, before clipping."""
        return self._protrain_engine().get_global_grad_norm()

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float | None:
        return self._protrain_engine().get_global_grad_norm() if grad_norm is None else grad_norm

    # ---------------------------------------------------------------- saving and resuming

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidated weights that ``from_pretrained`` loads (a PEFT model: its adapter),
        streamed out of the engine's chunks (``engine.save_pretrained``: never the whole model
        at once), with what the Trainer saves beside them (the processing class, the training
        arguments); every rank must call it (the chunks are gathered), rank 0 writes."""
        if self._engine is None:  # never trained: the model still holds its own weights
            self._refuse_if_ended()
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        directory = output_dir or self.args.output_dir
        self._engine.save_pretrained(directory)
        if self.args.should_save:
            self._save_beside_weights(directory)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)  # type: ignore[attr-defined]

    def _save_beside_weights(self, directory: str) -> None:
        """What ``Trainer._save`` writes beside the weights: the processing class (or the data
        collator's tokenizer) and the training arguments."""
        processing = self.processing_class  # type: ignore[attr-defined]
        if processing is None:
            processing = getattr(self.data_collator, "tokenizer", None)  # type: ignore[attr-defined]
        if processing is not None:
            processing.save_pretrained(directory)
        torch.save(self.args, os.path.join(directory, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (parameters, Adam state, loss scale, random streams; every
        rank writes its shard), the optimizer facade's learning rates and the scheduler."""
        self._protrain_engine().save_checkpoint(Path(output_dir) / ENGINE_CHECKPOINT)
        if self.args.should_save:
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_FILE))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing yet (the Trainer calls this before the engine exists): the engine loads its
        checkpoint in ``_load_optimizer_and_scheduler``. A folder without one is refused now."""
        if not (Path(resume_from_checkpoint) / ENGINE_CHECKPOINT).is_dir():
            raise SpecError(
                f"{resume_from_checkpoint} holds no ProTrain checkpoint ({ENGINE_CHECKPOINT}/): it was "
                "saved by a plain Trainer or with save_only_model=True; start from its weights with "
                "from_pretrained instead"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._protrain_engine().load_checkpoint(Path(checkpoint) / ENGINE_CHECKPOINT)
        self.optimizer.load_state_dict(torch.load(Path(checkpoint) / OPTIMIZER_FILE, weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=True))

    def end(self) -> None:
        """Close the engine (its threads, its process group), then the Trainer's own end; call it
        last: the model's weights lived in the engine's chunks (save_model first)."""
        if self._engine is not None:
            self._ended = True
            for hook in self._head_hooks:
                hook.remove()
            self._engine.close()
            self._engine = None
        super().end()  # type: ignore[misc]

    def _refuse_if_ended(self) -> None:
        """After ``end()`` the model's parameters are the closed engine's placeholders (its chunks
        held them): a new engine over them would train or evaluate on NaN, a save would write them."""
        if self._ended:
            raise RuntimeError(
                "ProTrainTrainer: the engine was closed by trainer.end(), and the model's weights with it; "
                "call end() last, after train, evaluate, predict and save_model"
            )


class ProTrainTrainer(ProTrainMixin, Trainer):
    """``transformers.Trainer`` training through the ProTrain engine; one extra argument,
    ``protrain=`` (see ``ProTrainMixin``)."""


@contextlib.contextmanager
def _backward_through(accelerator: Any, engine: Engine) -> Iterator[None]:
    """Trainer's ``training_step`` ends with ``self.accelerator.backward(loss)`` on a loss it has
    normalised over the window (by the window's label tokens, or by its micro-batches); during
    that step the call goes to the engine's backward, without the engine's own 1/accumulation."""

    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"ProTrainTrainer: backward options {sorted(kwargs)} are not the engine's")
        engine.backward(loss, scale_wrt_gas=False)

    before = accelerator.__dict__.get("backward")
    accelerator.backward = backward
    try:
        yield
    finally:
        if before is None:
            del accelerator.backward
        else:
            accelerator.backward = before

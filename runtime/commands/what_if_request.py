"""What a what-if question asks (``protrain-run --what-if``): the hardware file, the model, the
batch, and the update case (clipping, accumulation, precision), from flags or from a job spec's
``--config``, whose hand-set memory knobs, budgets and async saves join the plan too."""

from __future__ import annotations

from dataclasses import dataclass

from protrain.profiler.plan_builder import KnobRequest
from protrain.runtime.config.settings import chosen_knobs, keeps_gradients, knob, knob_request
from protrain.runtime.config.spec import AUTO, Precision
from protrain.runtime.config.spec_io import load_spec
from protrain.runtime.optim.registry import registered, rule_named
from protrain.runtime.optim.rule import OptimizerRule

SEARCHED_KNOBS = ("memory.chunk_size", "memory.n_persist", "memory.n_buffer", "memory.ssd.n_optimizer")
"""The knobs the search fills when no spec sets any (activations are placed by it too)."""
SPEC_DEFAULT = "the spec's default"


def optimizer_names() -> tuple[str, ...]:
    """The optimizer rules ``--optimizer`` takes (runtime/optim/registry.py)."""
    return registered()


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSettings:
    """What a job spec says that the what-if planner uses."""

    micro_batch_size: int | None
    accumulation_steps: int | None
    clipping: bool
    precision: str | None
    """None for ``auto`` (the Trainer's choice at run time), as are the two above."""
    knobs: KnobRequest
    chosen: tuple[str, ...]
    device_budget: int | None
    """Hand-set ``memory.device_budget`` (None: the hardware file's GPU less a reserve)."""
    host_budget: int | None
    """Hand-set ``memory.host_budget`` (None: its host RAM less a reserve, per rank)."""
    ssd: bool
    """``memory.ssd.path`` is set: activations may go to the hardware file's disk."""
    async_save: bool
    """``checkpoint.async_save``: each save stages the rank's state in host memory first."""
    optimizer: str = "adamw"
    momentum: float = 0.0
    """``optimizer.type`` and (sgd) ``optimizer.momentum``: the state the plan counts."""


def job_settings(path: str) -> JobSettings:
    """A job spec's settings; the spec is validated whole, as the launcher validates it (a bad
    file raises SpecError naming the key)."""
    spec = load_spec(path)
    memory = spec.memory
    # Not planning_settings_from_spec: it refuses the training fields' "auto", which a spec for
    # ProTrainTrainer may hold.
    return JobSettings(
        micro_batch_size=None if spec.micro_batch_size == AUTO else spec.micro_batch_size,
        accumulation_steps=None if spec.gradient_accumulation_steps == AUTO else spec.gradient_accumulation_steps,
        clipping=bool(spec.gradient_clipping),  # "auto" too: TrainingArguments.max_grad_norm is 1.0 unless set
        precision=None if spec.precision == AUTO else Precision(spec.precision).value,
        knobs=knob_request(memory),
        chosen=chosen_knobs(spec),
        device_budget=knob(memory.device_budget),
        host_budget=knob(memory.host_budget),
        ssd=memory.ssd.path is not None,
        async_save=spec.checkpoint.async_save,
        optimizer=spec.optimizer.type,
        momentum=spec.optimizer.momentum,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatIfRequest:
    """One what-if question: a hardware file, and a model config or the whole GPT family."""

    hardware: str
    """The hardware file, as the user wrote it (errors name it so)."""
    model_config: str | None
    """A config.json path, a directory holding one, or a known config name; None with ``largest``."""
    largest: bool
    micro_batch_size: int
    seq_len: int
    precision: str
    ssd: bool = False
    """Let the search put activations on the hardware file's disk (it must describe one)."""
    clipping: bool = False
    """Plan for gradient clipping (the update waits for the norm; gradients are kept)."""
    clipping_from: str = SPEC_DEFAULT
    """Where ``clipping`` came from, for the titles: the spec's default, a flag or a job file."""
    accumulation_steps: int = 1
    frozen: tuple[str, ...] = ()
    """Shell-style patterns over ``profiler.analytic.parameter_list``'s names: frozen parameters
    (a fine-tuned base: one compute copy, no gradient, no optimizer state)."""
    job: JobSettings | None = None
    """A job spec's settings (``--config``): its hand-set memory knobs, budgets and async saves."""
    config: str | None = None
    """The job file the settings came from, for the titles."""
    optimizer: str = "adamw"
    """The optimizer rule (runtime/optim/): its state bytes and its update's cost."""
    momentum: float = 0.0
    """sgd's momentum: with it, SGD keeps a momentum buffer."""

    @property
    def optimizer_rule(self) -> OptimizerRule:
        return rule_named(self.optimizer).for_momentum(self.momentum)

    @property
    def optimizer_states(self) -> int:
        return len(self.optimizer_rule.state_names)

    def optimizer_words(self) -> str:
        """The rule and its state, for the summary ("two Adam moments", "Lion's moment", ...)."""
        names = self.optimizer_rule.state_names
        return f"{self.optimizer} state: {', '.join(names)}" if names else f"{self.optimizer}: no optimizer state"

    @property
    def updates_after_norm(self) -> bool:
        return self.clipping or self.precision == "fp16"

    @property
    def keeps_gradients(self) -> bool:
        return keeps_gradients(
            gradient_clipping=1.0 if self.clipping else 0.0,
            loss_scaled=self.precision == "fp16",
            accumulation_steps=self.accumulation_steps,
        )

    def update_words(self) -> str:
        """The update case assumed, for the tables' titles."""
        clipping = f"clipping {'on' if self.clipping else 'off'} ({self.clipping_from})"
        window = f", {self.accumulation_steps} micro-batches a window" if self.accumulation_steps > 1 else ""
        held = 4 * (1 + self.optimizer_states + (1 if self.keeps_gradients else 0))
        kept = "gradients kept" if self.keeps_gradients else "gradients applied as they arrive"
        rule = "" if self.optimizer == "adamw" else f", {self.optimizer_rule.name}"
        momentum = f" (momentum {self.momentum:g})" if self.momentum else ""
        return f"{clipping}{window}{rule}{momentum}: {kept}, {held} host bytes per offloaded parameter"

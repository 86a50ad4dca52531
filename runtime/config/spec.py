"""The job spec: one pydantic model tree, parsed once at the edge (launcher or ``initialize``).

Every leaf is strictly typed (no bool for an int, no float for an int, no string for a number),
unknown keys are errors at every level, and ``"auto"`` is accepted only by the fields that the
profiler (or the launcher, for ``nproc_per_node``) fills in. Below ``initialize`` nothing reads
this object: components take plain values from the ``Plan`` and from ``TrainingSettings``.

Importing this module must not import torch: the launcher validates bad input in milliseconds.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, get_args, get_origin

from pydantic import BaseModel, Field, model_validator
from pydantic.fields import FieldInfo

from protrain.profiler.plan import BlockMode
from protrain.runtime.config.spec_types import (
    AUTO,
    AutoFilled,
    AutoNonNegInt,
    AutoPositiveInt,
    AutoSize,
    AutoText,
    BlockModes,
    Bool,
    Fraction,
    NonNegFloat,
    NonNegInt,
    ParamGroups,
    Port,
    PositiveFloat,
    PositiveInt,
    Resume,
    Size,
    SpecModel,
    Text,
    TextList,
    TrainerBetas,
    TrainerFilled,
    TrainerNonNegFloat,
    TrainerNonNegInt,
    TrainerPositiveFloat,
    TrainerPositiveInt,
    cross_field_error,
    enum_leaf,
    registered_leaf,
)
from protrain.runtime.optim.registry import REFUSED, registered

# The leaf types (sizes, "auto", bounded numbers) and their strict parsing: runtime/config/spec_types.py.


class Precision(str, Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class LogLevel(str, Enum):
    QUIET = "quiet"
    INFO = "info"
    DEBUG = "debug"


class NonFiniteLossPolicy(str, Enum):
    RAISE = "raise"
    SKIP = "skip"


class SchedulerType(str, Enum):
    WARMUP_COSINE = "warmup_cosine"
    CONSTANT = "constant"


PrecisionField = Annotated[(Precision | Literal["auto"], *enum_leaf(Precision, trainer_auto=True))]
NonFiniteField = Annotated[(NonFiniteLossPolicy, *enum_leaf(NonFiniteLossPolicy))]
LogLevelField = Annotated[(LogLevel, *enum_leaf(LogLevel))]
OptimizerTypeField = Annotated[
    (str, *registered_leaf(registered, "runtime/optim/registry.py registers more", lambda: REFUSED))
]
SchedulerTypeField = Annotated[(SchedulerType, *enum_leaf(SchedulerType))]


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


class LossScalingSpec(SpecModel):
    """Dynamic loss scaling for fp16: the scale halves on overflow and doubles after a run of
    clean steps."""

    initial: PositiveFloat = 65536.0
    """Scale at the first step."""
    growth_interval: PositiveInt = 1000
    """Overflow-free steps before the scale doubles."""
    min_scale: PositiveFloat = 1.0
    """The scale never goes below this."""

    @model_validator(mode="after")
    def _min_below_initial(self) -> LossScalingSpec:
        if self.min_scale > self.initial:
            raise cross_field_error(
                "min_scale",
                f"min_scale ({self.min_scale:g}) must be <= initial ({self.initial:g})",
            )
        return self


class OptimizerSpec(SpecModel):
    """The optimizer: AdamW (decoupled weight decay, the same update as ``torch.optim.AdamW``)
    unless ``type`` names another rule: adam (``torch.optim.Adam``: weight decay added to the
    gradient), lion (the published Lion: sign of the interpolated moment, decoupled weight
    decay; betas are its b1, b2) or sgd (``torch.optim.SGD``); docs/optimizers.md."""

    type: OptimizerTypeField = "adamw"
    """Optimizer rule."""
    lr: TrainerPositiveFloat = 3.0e-4
    """Peak learning rate."""
    betas: TrainerBetas = (0.9, 0.95)
    """Adam's two moment decay rates."""
    eps: TrainerPositiveFloat = 1.0e-8
    """Added to Adam's denominator."""
    weight_decay: TrainerNonNegFloat = 0.1
    """Weight decay, applied to every parameter not matched by no_decay: decoupled (adamw,
    lion) or added to the gradient as L2 (adam, sgd), as each reference does."""
    momentum: NonNegFloat = 0.0
    """sgd only: momentum (0: plain SGD, no momentum buffer kept)."""
    dampening: NonNegFloat = 0.0
    """sgd only: dampening of the momentum's gradient term."""
    nesterov: Bool = False
    """sgd only: Nesterov momentum (needs momentum > 0 and dampening 0)."""
    no_decay: TextList = ("bias", "norm")
    """Patterns exempt from weight decay: a parameter matches when a pattern occurs in its
    lower-cased name or in the lower-cased class name of the module that owns it."""
    groups: ParamGroups = ()
    """Parameter groups, in order: [{match: ["*lora_*"], lr: 1.0e-4, weight_decay: 0.0, betas:
    [0.9, 0.99]}, ...]. A parameter takes the first entry one of whose shell-style patterns
    matches its whole name (``*`` crosses dots), the others the top-level lr, weight_decay and
    betas; an entry's lr is scaled by the scheduler like the top-level one, and no_decay still
    exempts biases and norms from its weight_decay. An entry may match nothing."""

    @model_validator(mode="after")
    def _sgd_fields(self) -> OptimizerSpec:
        if self.type != "sgd":
            for name in ("momentum", "dampening", "nesterov"):
                if getattr(self, name):
                    raise cross_field_error(name, f"{name} applies to type sgd only (this optimizer is {self.type})")
        if self.nesterov and (self.momentum == 0.0 or self.dampening != 0.0):
            raise cross_field_error("nesterov", "nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
        return self


DEFAULT_MIN_LR_RATIO = 0.1


class SchedulerSpec(SpecModel):
    """Learning-rate schedule, stepped once per optimizer update."""

    type: SchedulerTypeField = SchedulerType.CONSTANT
    """warmup_cosine: linear warmup then cosine decay to min_lr_ratio x lr; constant: linear
    warmup then lr."""
    warmup_steps: NonNegInt = 0
    """Updates of linear warmup from lr/warmup_steps up to lr."""
    total_steps: PositiveInt | None = Field(default=None)
    """Updates over which warmup_cosine decays (required for it); also the progress bar's end."""
    min_lr_ratio: Fraction | None = None
    """warmup_cosine only: the final learning rate as a fraction of lr (default 0.1)."""

    @model_validator(mode="after")
    def _consistent(self) -> SchedulerSpec:
        if self.type is SchedulerType.WARMUP_COSINE and self.total_steps is None:
            raise cross_field_error("total_steps", "warmup_cosine needs total_steps")
        if self.type is SchedulerType.CONSTANT and self.min_lr_ratio is not None:
            raise cross_field_error("min_lr_ratio", "min_lr_ratio applies only to warmup_cosine")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise cross_field_error(
                "warmup_steps",
                f"warmup_steps ({self.warmup_steps}) must be <= total_steps ({self.total_steps})",
            )
        return self


class SsdSpec(SpecModel):
    """Activation and optimizer-state offload to files (SSDTrain; ZeRO-Infinity's NVMe tier)."""

    path: Text | None = None
    """Directory for activation and optimizer-state files (a fast local NVMe disk); null: no
    SSD tier."""
    n_offload: AutoNonNegInt = AUTO
    """Blocks whose activations go to files under path."""
    n_optimizer: AutoNonNegInt = AUTO
    """Offloaded chunks (the last ones holding trainable parameters) whose optimizer state
    lives in files under path instead of host memory, read ahead of each update and written
    behind it. auto: with path set, as few as let the fastest plan fit host memory (none where
    everything fits without); without path, none."""
    max_writes_per_day: Size | None = None
    """Bytes a rank's NVMe optimizer state may write per day of training (SSDs wear) before the
    planner prefers plans that write less; null: no limit (the plan table shows the rate)."""


class MemorySpec(SpecModel):
    """Memory knobs. "auto" ones are filled by the planner; a value set by hand is kept."""

    device_budget: AutoSize = AUTO
    """Device bytes per rank. auto: CUDA total minus a reserve, less what other live engines of
    the process hold; on CPU this rank's share of free RAM."""
    host_budget: AutoSize = AUTO
    """Host bytes per rank. auto: the smallest of available RAM, the cgroup limit less its usage
    and Slurm's allocation, less a 2 GiB reserve, shared by the ranks on this host, plus what
    this process holds already."""
    chunk_size: AutoSize = AUTO
    """Bytes per model-state chunk."""
    n_persist: AutoNonNegInt = AUTO
    """Chunks kept on the device for the whole step (the first ones in execution order)."""
    n_buffer: AutoNonNegInt = AUTO
    """Device chunk buffers that the non-persistent chunks pass through."""
    n_replicate: AutoNonNegInt = AUTO
    """Of the persistent chunks, how many (the first ones) are replicated on every rank, their
    gradients all-reduced as DDP's, instead of sharded. auto: on several ranks, as many as fit
    when the cost model finds that faster (none until a batch is profiled)."""
    n_swap: AutoNonNegInt = AUTO
    """Transformer blocks whose activations are copied to host memory."""
    n_checkpoint: AutoNonNegInt = AUTO
    """Transformer blocks recomputed in backward."""
    ssd: SsdSpec = Field(default_factory=SsdSpec)
    """SSD activation tier."""
    blocks: AutoText = AUTO
    """Module path of the transformer block list, e.g. model.layers. auto: found in the model."""
    block_modes: BlockModes | None = None
    """An explicit mode per block (keep, swap, checkpoint, ssd); overrides the counts."""

    @model_validator(mode="after")
    def _consistent(self) -> MemorySpec:
        explicit_offload = self.ssd.n_offload not in (AUTO, 0)
        if explicit_offload and self.ssd.path is None:
            raise cross_field_error("ssd.path", f"ssd.n_offload={self.ssd.n_offload} needs ssd.path (a directory)")
        if self.ssd.n_optimizer not in (AUTO, 0) and self.ssd.path is None:
            raise cross_field_error("ssd.path", f"ssd.n_optimizer={self.ssd.n_optimizer} needs ssd.path (a directory)")
        if self.block_modes is not None:
            if BlockMode.SSD in self.block_modes and self.ssd.path is None:
                raise cross_field_error("ssd.path", "block_modes contains ssd; set ssd.path")
            counts = {
                "n_swap": (self.n_swap, BlockMode.SWAP),
                "n_checkpoint": (self.n_checkpoint, BlockMode.CHECKPOINT),
                "ssd.n_offload": (self.ssd.n_offload, BlockMode.SSD),
            }
            for key, (count, mode) in counts.items():
                listed = self.block_modes.count(mode)
                if count != AUTO and count != listed:
                    raise cross_field_error(
                        key,
                        f"{key}={count} disagrees with block_modes, which lists {listed} "
                        f"{mode.value} block(s); leave {key} as auto",
                    )
        return self


class ProfilerSpec(SpecModel):
    """Profiling steps and the cache of measured profiles."""

    cache_dir: Text = "~/.cache/protrain"
    """Where measured profiles are cached."""
    warmup_steps: NonNegInt = 1
    """Steps run before measuring."""
    profile_steps: PositiveInt = 2
    """Steps measured, at most: measuring stops once a step takes within 5% of the step before
    it (the warm-up step counts)."""


class LauncherSpec(SpecModel):
    """How protrain-run starts the ranks; its command-line options win over this section."""

    nproc_per_node: AutoPositiveInt = AUTO
    """Ranks on this node. auto: one per GPU, or 1 on a machine without CUDA."""
    nnodes: PositiveInt = 1
    """Nodes in the job."""
    node_rank: NonNegInt = 0
    """This node's rank (static rendezvous); must be below nnodes."""
    master_addr: Text = "127.0.0.1"
    """Address of node 0 (rendezvous and process-group store)."""
    master_port: Port = 29500
    """Port on master_addr; 0 picks a free port (single node only)."""
    max_restarts: NonNegInt = 0
    """Times the elastic agent restarts the whole group after a rank fails."""
    shutdown_grace_s: PositiveFloat = 30.0
    """Seconds ranks get after Ctrl-C/SIGTERM of the launcher before SIGKILL (when a rank fails,
    torch's agent stops the others with its own 30 s)."""
    dist_timeout_s: PositiveFloat = 600.0
    """Timeout of collectives in the process group."""

    @model_validator(mode="after")
    def _consistent(self) -> LauncherSpec:
        if self.node_rank >= self.nnodes:
            raise cross_field_error("node_rank", f"node_rank ({self.node_rank}) must be below nnodes ({self.nnodes})")
        if self.master_port == 0 and self.nnodes > 1:
            raise cross_field_error("master_port", "master_port 0 (a free port) works only with nnodes 1")
        return self


class CheckpointSpec(SpecModel):
    """Checkpoints and resume."""

    dir: Text | None = None
    """Directory holding checkpoints; null: no checkpoints."""
    interval_steps: NonNegInt = 0
    """Save every this many optimizer steps; 0: never periodically."""
    resume: Resume = "auto"
    """auto: the latest complete checkpoint in dir; never; or a checkpoint directory."""
    async_save: Bool = False
    """Write checkpoints in the background, from a copy in host memory (12 bytes per trainable
    parameter per rank, counted in the plan's host figure)."""
    keep_last: PositiveInt = 2
    """Checkpoints kept in dir; older ones are removed."""

    @model_validator(mode="after")
    def _consistent(self) -> CheckpointSpec:
        if self.interval_steps > 0 and self.dir is None:
            raise cross_field_error("dir", f"interval_steps={self.interval_steps} needs dir (a directory)")
        return self


class WandbSpec(SpecModel):
    """Weights & Biases, used only when its package is installed."""

    project: Text
    """The W&B project the run goes to."""
    name: Text | None = None
    """The run's name (null: W&B picks one)."""


class TraceSpec(SpecModel):
    """A profiler trace of a few updates (Chrome JSON per rank under the run folder)."""

    start_step: PositiveInt
    """The first optimizer update traced (1: the first)."""
    steps: PositiveInt = 2
    """Updates traced from there."""


class LoggingSpec(SpecModel):
    """Where the training metrics go besides metrics.jsonl and the console (rank 0 only)."""

    level: LogLevelField = LogLevel.INFO
    """What rank 0 prints: quiet (warnings only), info (the plan table, a progress line every
    few updates, the plan check), debug (also a line every update, with its waits)."""
    every_steps: PositiveInt = 1
    """Write the metrics to the trackers every this many optimizer updates."""
    tensorboard: Bool = False
    """TensorBoard event files under the run folder (needs the tensorboard package)."""
    wandb: WandbSpec | None = None
    """Weights & Biases: {project, name}; null: off."""
    trace: TraceSpec | None = None
    """A profiler trace of updates start_step .. start_step + steps - 1; null: off."""


class Spec(SpecModel):
    """A ProTrain job."""

    seed: TrainerNonNegInt = 1234
    """Seed of every random generator the engine owns (offset by rank where ranks must differ)."""
    micro_batch_size: TrainerPositiveInt = 1
    """Samples per rank per forward."""
    gradient_accumulation_steps: TrainerPositiveInt = 1
    """Micro-batches per optimizer update; the loss is scaled by 1/this in backward."""
    precision: PrecisionField = Precision.FP32
    """Compute precision; masters and optimizer state stay fp32."""
    loss_scaling: LossScalingSpec | None = None
    """fp16 only: dynamic loss scaling (defaults apply when precision is fp16 and this is null)."""
    gradient_clipping: TrainerNonNegFloat | None = None
    """Clip the global gradient norm to this; 0 or null: off."""
    on_nonfinite_loss: NonFiniteField = NonFiniteLossPolicy.RAISE
    """raise, or skip the update; decided alike on every rank."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """Optimizer and parameter groups."""
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    """Learning-rate schedule."""
    memory: MemorySpec = Field(default_factory=MemorySpec)
    """Placement of model state and activations."""
    profiler: ProfilerSpec = Field(default_factory=ProfilerSpec)
    """Profiling before planning."""
    launcher: LauncherSpec = Field(default_factory=LauncherSpec)
    """protrain-run's launch settings."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpoints and resume."""
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    """Metrics trackers and profiler traces."""
    output_dir: Text = "runs"
    """Each launch writes its resolved spec and metrics.jsonl under a new folder here."""

    @model_validator(mode="after")
    def _consistent(self) -> Spec:
        precision = self.precision
        if self.loss_scaling is not None and precision != AUTO and precision is not Precision.FP16:
            raise cross_field_error(
                "loss_scaling",
                f"loss_scaling applies only to precision fp16 (precision is {precision.value}); remove it",
            )
        return self

    @property
    def effective_loss_scaling(self) -> LossScalingSpec | None:
        """The loss scaling in force: the spec's, the defaults under fp16, else None."""
        if self.precision is not Precision.FP16:
            return None
        return self.loss_scaling or LossScalingSpec()


def trainer_autos(spec: BaseModel) -> list[str]:
    """Key paths of the training fields still "auto": only the Hugging Face Trainer integration
    fills them (from TrainingArguments), as DeepSpeed's config takes "auto" there."""
    return _auto_paths(spec, TrainerFilled)


def auto_fields(spec: BaseModel) -> list[str]:
    """Key paths of the fields whose value is still the "auto" placeholder."""
    return _auto_paths(spec, AutoFilled)


def _auto_paths(spec: BaseModel, marker: type, prefix: str = "") -> list[str]:
    """Key paths of the fields still "auto" whose type carries ``marker``."""
    found: list[str] = []
    for name, info in type(spec).model_fields.items():
        value = getattr(spec, name)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            found.extend(_auto_paths(value, marker, path + "."))
        elif isinstance(value, str) and value == AUTO and _marked(info, marker):
            found.append(path)
    return found


def _marked(info: FieldInfo, marker: type) -> bool:
    markers = list(info.metadata)
    for arg in get_args(info.annotation):  # a Trainer type | None keeps its markers inside
        if get_origin(arg) is Annotated:
            markers.extend(get_args(arg)[1:])
    return any(isinstance(item, marker) for item in markers)

"""What a ``ProTrainTrainer`` refuses up front, each with the ProTrain way to get it.

Trainer options that would fight the engine over the same job (sharding, recompute, compiling,
the optimizer), or that need what the engine does not offer yet, stop the run before anything
is built, as a ``SpecError`` (a ``ValueError``; exit 2 through protrain-run) naming the option.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.integrations.hf_optim import optim_name, refusal


def refuse_clashing_args(args: Any) -> None:
    """Raise for the first TrainingArguments option that cannot run under ProTrain."""
    optim_refusal = refusal(optim_name(args))
    clashes: list[tuple[bool, str]] = [
        (
            bool(args.deepspeed),
            "deepspeed: ProTrain shards and offloads the model state itself (the spec's memory "
            "section plans what a ZeRO-3 offload config would); remove deepspeed=",
        ),
        (
            bool(args.fsdp),
            "fsdp: ProTrain shards the model state across ranks itself (ZeRO-3); remove fsdp=",
        ),
        (
            bool(getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)),
            "gradient_checkpointing: ProTrain recomputes blocks by its plan; leave memory.n_checkpoint "
            "auto or set it in the spec, and set gradient_checkpointing=False (TRL's configs turn it on "
            "by default)",
        ),
        (
            bool(getattr(args, "use_liger_kernel", False)),
            "use_liger_kernel: Liger's fused LM-head loss reads the head's weight without running the "
            "head module, which an offloaded chunk only holds while its module runs (the loss would "
            "be NaN); remove use_liger_kernel=",
        ),
        (
            bool(args.torch_compile),
            "torch_compile: the engine's chunk and activation hooks do not run under torch.compile; "
            "remove torch_compile=",
        ),
        (optim_refusal is not None, optim_refusal or ""),
        (
            bool(args.load_best_model_at_end),
            "load_best_model_at_end: not supported under ProTrain yet (the best checkpoint-N folder "
            "holds consolidated weights to load with from_pretrained after training)",
        ),
        (
            bool(args.auto_find_batch_size),
            "auto_find_batch_size: the memory plan fits the batch you give; set "
            "per_device_train_batch_size (the plan says whether it fits)",
        ),
        (
            bool(args.bf16_full_eval or args.fp16_full_eval),
            "bf16_full_eval/fp16_full_eval: the engine evaluates under its own precision (the spec's "
            "precision, or bf16/fp16); remove the full-eval cast",
        ),
        (
            args.n_gpu > 1,
            f"{args.n_gpu} GPUs in one process (DataParallel): ProTrain runs one process per GPU; "
            "launch with protrain-run or torchrun",
        ),
        _ranks_unseen(args),
    ]
    for clash, message in clashes:
        if clash:
            raise SpecError(f"ProTrainTrainer: {message}")
    engine_device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.type != engine_device:
        raise SpecError(
            f"ProTrainTrainer: TrainingArguments place the batches on {args.device.type}, the engine "
            f"trains on {engine_device}; remove use_cpu=True (or hide the GPUs: CUDA_VISIBLE_DEVICES=)"
        )


def refuse_own_optimizer(trainer: Any) -> None:
    """The engine's optimizer is the only one: a Trainer given its own is refused."""
    if trainer.optimizer is not None or getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        raise SpecError(
            "ProTrainTrainer: optimizers=/optimizer_cls_and_kwargs=: the engine runs its optimizer on its "
            "chunks; set its values in TrainingArguments or the spec's optimizer section"
        )
    if trainer.lr_scheduler is not None:
        raise SpecError(
            "ProTrainTrainer: optimizers=(None, scheduler): a scheduler must be built over the engine's "
            "optimizer; set lr_scheduler_type in TrainingArguments or the spec's scheduler section, or "
            "override create_scheduler"
        )


def _ranks_unseen(args: Any) -> tuple[bool, str]:
    """The Trainer must see the ranks the launcher started, or each rank trains the same batches
    (its loader is not sharded) while the engine averages them as if they differed. On CPU,
    transformers sets up several processes only with ``use_cpu=True``."""
    started = int(os.environ.get("WORLD_SIZE", "1"))
    seen = int(args.world_size)
    fix = (
        "pass use_cpu=True in TrainingArguments (--use_cpu) on a machine without a GPU, so each rank "
        "reads its own shard of the data"
        if not torch.cuda.is_available()
        else "launch with protrain-run or torchrun and leave the Trainer's distributed setup to them"
    )
    return (
        started > 1 and seen != started,
        f"TrainingArguments see {seen} process(es) but {started} ranks were started: every rank would "
        f"train the same batches; {fix}",
    )

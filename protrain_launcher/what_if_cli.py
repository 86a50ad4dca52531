"""``protrain-run --what-if``: the command line of the memory estimator and what-if planning (what
a model needs on hardware that is not here, from a hardware file and a model config; no script,
no ranks, no torch).

    protrain-run --what-if configs/hardware/a100-80gb.yaml --model-config config.json
    protrain-run --what-if configs/hardware/a100-80gb.yaml --largest
    protrain-run --what-if configs/hardware/h100-80gb.yaml --model-config llama-2-70b --config job.yaml

This module reads the arguments; the planning and its tables are ``runtime/commands/what_if.py``
and ``runtime/commands/memory_estimate.py``.
"""

from __future__ import annotations

import argparse
from typing import TypeVar

from protrain.launcher.request import EXIT_OK
from protrain.runtime.commands.what_if import MODEL_NAMES, run_what_if
from protrain.runtime.commands.what_if_request import SPEC_DEFAULT, WhatIfRequest, job_settings, optimizer_names
from protrain.runtime.config.spec_io import SpecError

T = TypeVar("T")


def build_parser() -> argparse.ArgumentParser:
    """The what-if options. argparse's own usage errors (exit 2, usage on stderr) are kept."""
    parser = argparse.ArgumentParser(
        prog="protrain-run --what-if",
        description="The memory estimator: for a model config on a hardware file, the device, host "
        "and SSD bytes per rank and the predicted step time of each placement of model state and "
        "activations, then the plan the search picks; or the largest model of a GPT family that fits.",
    )
    parser.add_argument("--what-if", dest="hardware", required=True, metavar="HARDWARE.yaml")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--model-config",
        metavar="CONFIG.json",
        help="HF config.json (or its directory), the repo's GPT config, or a name: " + ", ".join(MODEL_NAMES),
    )
    target.add_argument("--largest", action="store_true", help="the largest GPT-family model that fits")
    parser.add_argument(
        "--config",
        metavar="JOB.yaml",
        help="take micro_batch_size, gradient_accumulation_steps, precision, gradient_clipping, "
        "hand-set memory knobs and budgets, memory.ssd.path and checkpoint.async_save from a job "
        "spec; the flags below override it",
    )
    parser.add_argument("--micro-batch-size", type=int, help="default 1, or the job spec's")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), help="default bf16, or the job spec's")
    parser.add_argument(
        "--ssd",
        action="store_true",
        help="let the search put activations on the hardware file's SSD (as memory.ssd.path does)",
    )
    parser.add_argument(
        "--clipping",
        action=argparse.BooleanOptionalAction,
        help="plan for gradient_clipping on (the Hugging Face Trainer's default, max_grad_norm 1.0): "
        "offloaded chunks keep an fp32 gradient shard until the norm is known, 16 host bytes per "
        "parameter; off (the spec's default, unless --config sets it), 12",
    )
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        help="above 1, gradients are kept across micro-batches: 16 host bytes per parameter "
        "(default 1, or the job spec's)",
    )
    parser.add_argument(
        "--optimizer",
        metavar="NAME",
        help="the optimizer whose state and update the plan counts: adamw and adam keep two fp32 "
        "moments per parameter, lion one, sgd one with --momentum and none without (default adamw, "
        "or the job spec's)",
    )
    parser.add_argument("--momentum", type=float, help="sgd's momentum (default 0, or the job spec's)")
    parser.add_argument(
        "--frozen",
        action="append",
        default=[],
        metavar="PATTERN",
        help="freeze the parameters whose names match (shell-style, repeatable: 'layers.*' "
        "freezes every block, '*' the whole base as under LoRA): one compute copy each, no "
        "gradient or optimizer state. Names: embed_tokens, embed_positions, layers.N.qkv, "
        "layers.N.attn_out, layers.N.fc|proj (gate|up|down), layers.N.norm_1|norm_2, final_norm, lm_head",
    )
    return parser


def parse_what_if(argv: list[str]) -> WhatIfRequest:
    """The request ``argv`` asks for; SpecError for a batch shape below 1 or a job spec that
    cannot be read."""
    args = build_parser().parse_args(argv)
    job = job_settings(args.config) if args.config else None
    micro_batch_size = _pick(args.micro_batch_size, job and job.micro_batch_size, 1)
    accumulation = _pick(args.gradient_accumulation_steps, job and job.accumulation_steps, 1)
    if micro_batch_size < 1 or args.seq_len < 1 or accumulation < 1:
        raise SpecError("--micro-batch-size, --seq-len and --gradient-accumulation-steps must be >= 1")
    optimizer = _pick(args.optimizer, job and job.optimizer, "adamw")
    if optimizer not in optimizer_names():
        raise SpecError(f"--optimizer {optimizer}: not one of {', '.join(optimizer_names())}")
    momentum = _pick(args.momentum, job.momentum if job and job.optimizer == optimizer else None, 0.0)
    if momentum and optimizer != "sgd":
        raise SpecError(f"--momentum applies to --optimizer sgd only (the optimizer is {optimizer})")
    if momentum < 0:
        raise SpecError(f"--momentum must be >= 0, got {momentum:g}")
    if args.clipping is not None:
        clipping, clipping_from = bool(args.clipping), "--clipping" if args.clipping else "--no-clipping"
    elif job is not None:
        clipping, clipping_from = job.clipping, str(args.config)
    else:
        clipping, clipping_from = False, SPEC_DEFAULT
    return WhatIfRequest(
        hardware=args.hardware,
        model_config=args.model_config,
        largest=bool(args.largest),
        micro_batch_size=micro_batch_size,
        seq_len=args.seq_len,
        precision=_pick(args.precision, job and job.precision, "bf16"),
        ssd=bool(args.ssd) or bool(job and job.ssd),
        clipping=clipping,
        clipping_from=clipping_from,
        accumulation_steps=accumulation,
        frozen=tuple(args.frozen),
        job=job,
        config=args.config,
        optimizer=optimizer,
        momentum=momentum,
    )


def _pick(flag: T | None, from_job: T | None, default: T) -> T:
    """A flag given on the command line, else the job spec's value, else the default."""
    if flag is not None:
        return flag
    return default if from_job is None else from_job


def main(argv: list[str]) -> int:
    """``protrain-run --what-if HARDWARE.yaml (--model-config CONFIG.json | --largest)``; returns
    the exit code (0 a plan, 1 nothing fits); bad input raises SpecError."""
    if "-h" in argv or "--help" in argv:
        # Before parsing: "--what-if --help" would be a missing HARDWARE.yaml to argparse.
        build_parser().print_help()
        return EXIT_OK
    return run_what_if(parse_what_if(argv))

"""``protrain-run --what-if``: the command line of the memory estimator and what-if planning (what
a model needs on hardware that is not here, from a hardware file and a model config; no script,
no ranks, no torch).

    protrain-run --what-if configs/hardware/a100-80gb.yaml --model-config config.json
    protrain-run --what-if configs/hardware/a100-80gb.yaml --largest

This module reads the arguments; the planning and its tables are ``runtime/planning/what_if.py``
and ``runtime/planning/memory_estimate.py``.
"""

from __future__ import annotations

import argparse

from protrain_launcher.request import EXIT_OK
from runtime.config.spec_io import SpecError
from runtime.planning.what_if import MODEL_NAMES, WhatIfRequest, run_what_if


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
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument(
        "--ssd",
        action="store_true",
        help="let the search put activations on the hardware file's SSD (as memory.ssd.path does)",
    )
    parser.add_argument(
        "--clipping",
        action="store_true",
        help="plan for gradient_clipping on: offloaded chunks keep an fp32 gradient shard until the "
        "norm is known (16 host bytes per parameter; without clipping, accumulation or fp16, 12)",
    )
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="above 1, gradients are kept across micro-batches: 16 host bytes per parameter",
    )
    return parser


def parse_what_if(argv: list[str]) -> WhatIfRequest:
    """The request ``argv`` asks for; SpecError for a batch shape below 1."""
    args = build_parser().parse_args(argv)
    if args.micro_batch_size < 1 or args.seq_len < 1 or args.gradient_accumulation_steps < 1:
        raise SpecError("--micro-batch-size, --seq-len and --gradient-accumulation-steps must be >= 1")
    return WhatIfRequest(
        hardware=args.hardware,
        model_config=args.model_config,
        largest=bool(args.largest),
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        precision=args.precision,
        ssd=bool(args.ssd),
        clipping=bool(args.clipping),
        accumulation_steps=args.gradient_accumulation_steps,
    )


def main(argv: list[str]) -> int:
    """``protrain-run --what-if HARDWARE.yaml (--model-config CONFIG.json | --largest)``; returns
    the exit code (0 a plan, 1 nothing fits); bad input raises SpecError."""
    if "-h" in argv or "--help" in argv:
        # Before parsing: "--what-if --help" would be a missing HARDWARE.yaml to argparse.
        build_parser().print_help()
        return EXIT_OK
    return run_what_if(parse_what_if(argv))

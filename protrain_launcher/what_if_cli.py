"""``protrain-run --what-if``: the command line of what-if planning (plan and predict for absent
hardware from a hardware file and a model config; no script, no ranks, no torch).

    protrain-run --what-if configs/hardware/a100-80gb.yaml --model-config config.json
    protrain-run --what-if configs/hardware/a100-80gb.yaml --largest

This module reads the arguments; the planning and its tables are ``runtime/planning/what_if.py``.
"""

from __future__ import annotations

import argparse

from runtime.config.spec_io import SpecError
from runtime.planning.what_if import WhatIfRequest, run_what_if


def build_parser() -> argparse.ArgumentParser:
    """The what-if options. argparse's own usage errors (exit 2, usage on stderr) are kept."""
    parser = argparse.ArgumentParser(
        prog="protrain-run --what-if",
        description="Plan and predict for absent hardware, from a hardware file and a model config.",
    )
    parser.add_argument("--what-if", dest="hardware", required=True, metavar="HARDWARE.yaml")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--model-config", metavar="CONFIG.json", help="HF config.json or the repo's GPT config"
    )
    target.add_argument("--largest", action="store_true", help="the largest GPT-family model that fits")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    return parser


def parse_what_if(argv: list[str]) -> WhatIfRequest:
    """The request ``argv`` asks for; SpecError for a batch shape below 1."""
    args = build_parser().parse_args(argv)
    if args.micro_batch_size < 1 or args.seq_len < 1:
        raise SpecError("--micro-batch-size and --seq-len must be >= 1")
    return WhatIfRequest(
        hardware=args.hardware,
        model_config=args.model_config,
        largest=bool(args.largest),
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        precision=args.precision,
    )


def main(argv: list[str]) -> int:
    """``protrain-run --what-if HARDWARE.yaml (--model-config CONFIG.json | --largest)``; returns
    the exit code (0 a plan, 1 nothing fits); bad input raises SpecError."""
    return run_what_if(parse_what_if(argv))

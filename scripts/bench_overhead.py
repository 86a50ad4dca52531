"""The chunk engine's overhead when nothing is offloaded: ProTrain with every chunk persistent vs
plain PyTorch training of the same model on the same batches.

    .venv/bin/python scripts/bench_overhead.py            # GPT 6 x 512, batch 4 x 256 tokens, fp32
    .venv/bin/python scripts/bench_overhead.py --smoke    # one tiny step of each (a test)

Both candidates start from the same weights (the same seed), train in fp32 on the same batches
and use the same update: plain PyTorch runs ``torch.optim.AdamW(fused=True)`` over the model's
parameters, ProTrain runs the same kernel over its flat chunk shards. Each candidate first takes
``--warmup`` untimed steps (allocator and kernel warm-up); then every repeat times ``--steps``
steps of each, the two interleaved and their order alternating from repeat to repeat, so that
drift of the machine (other jobs, frequency, memory) hits both alike. A step is forward,
backward and the optimizer update, timed on the host (on CPU every op is synchronous).
The table gives the median over repeats of seconds per step with its range, and the ratio
ours/plain, also as the median and range of the per-repeat ratios (each repeat's pair ran side
by side). Target: ours/plain <= 1.03x.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from bench_common import SEED, Batch, add_model_arguments, build_gpt, gpt_config, make_batches

from protrain import runtime
from protrain_demo.gpt import GPT
from protrain.runtime.param_groups import split_decay
from protrain.runtime.training.engine import Engine

LR = 3e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
NO_DECAY = ("bias", "norm")
TARGET_RATIO = 1.03


@dataclass
class Candidate:
    """One way of training, stepped over the shared batch list; seconds per step per repeat."""

    name: str
    train_step: Callable[[Batch], torch.Tensor]
    """Forward, backward and update on one batch; returns the (detached) loss."""
    seconds: list[float] = field(default_factory=list)
    steps_taken: int = 0
    last_loss: float = float("nan")

    def run(self, batches: Sequence[Batch], num_steps: int) -> float:
        """Take the next ``num_steps`` steps; their wall time in seconds."""
        start = time.perf_counter()
        for _ in range(num_steps):
            loss = self.train_step(batches[self.steps_taken])
            self.steps_taken += 1
        elapsed = time.perf_counter() - start
        if num_steps:
            self.last_loss = float(loss)
        return elapsed

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per candidate per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate first")
    parser.add_argument("--smoke", action="store_true", help="one tiny step of each (a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.heads, args.seq_len, args.batch = 2, 64, 2, 32, 2
        args.steps, args.repeats, args.warmup = 1, 1, 0
    if min(args.layers, args.width, args.heads, args.seq_len, args.batch, args.steps, args.repeats) < 1:
        parser.error("sizes, --steps and --repeats must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def job_spec(args: argparse.Namespace, output_dir: str, **memory: Any) -> dict[str, Any]:
    """fp32, constant learning rate, no clipping: the update plain PyTorch makes below."""
    return {
        "seed": SEED,
        "micro_batch_size": args.batch,
        "precision": "fp32",
        "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        "memory": memory,
        "output_dir": output_dir,
    }


def quiet_initialize(model: GPT, config: dict[str, Any], example_batch: Batch) -> Engine:
    """``runtime.initialize`` with the plan table and the per-step progress lines sent to a
    buffer: the engine's console binds stdout when it is built, and the benchmark's own table
    should be the only output."""
    with contextlib.redirect_stdout(io.StringIO()):
        return runtime.initialize(model, config=config, example_batch=example_batch)


def protrain_step(engine: Engine) -> Callable[[Batch], torch.Tensor]:
    def train_step(batch: Batch) -> torch.Tensor:
        out = engine(**batch)
        engine.backward(out.loss)
        engine.step()
        return out.loss.detach()

    return train_step


def plain_step(model: GPT) -> Callable[[Batch], torch.Tensor]:
    decay, exempt = split_decay(model, NO_DECAY)
    optimizer = torch.optim.AdamW(
        [
            {"params": [p.param for p in decay], "weight_decay": WEIGHT_DECAY},
            {"params": [p.param for p in exempt], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        fused=True,
    )

    def train_step(batch: Batch) -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return train_step


def run_interleaved(
    candidates: Sequence[Candidate], batches: Sequence[Batch], *, steps: int, repeats: int, warmup: int
) -> None:
    """Warm-up, then per repeat ``steps`` timed steps of each candidate, alternating which goes
    first so neither always runs right after the other's (cache-cold) turn."""
    for candidate in candidates:
        candidate.run(batches, warmup)
    for repeat in range(repeats):
        order = candidates if repeat % 2 == 0 else list(reversed(candidates))
        for candidate in order:
            candidate.seconds.append(candidate.run(batches, steps) / steps)


def print_table(plain: Candidate, ours: Candidate, *, args: argparse.Namespace, header: str) -> None:
    ratios = [o / p for o, p in zip(ours.seconds, plain.seconds, strict=True)]
    ratio = ours.median_s / plain.median_s
    print(header)
    title = f"{'candidate':<34}{'s/step':>9}{'min-max (s)':>17}{'ratio':>9}{'final loss':>12}"
    print(title)
    print("-" * len(title))
    for candidate in (plain, ours):
        spread = f"{min(candidate.seconds):.4f}-{max(candidate.seconds):.4f}"
        print(
            f"{candidate.name:<34}{candidate.median_s:>9.4f}{spread:>17}"
            f"{candidate.median_s / plain.median_s:>8.3f}x{candidate.last_loss:>12.5f}"
        )
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(
        f"ours/plain: {ratio:.3f}x from the medians; per-repeat ratios median "
        f"{statistics.median(ratios):.3f}x, range {min(ratios):.3f}-{max(ratios):.3f}x "
        f"(target <= {TARGET_RATIO:.2f}x: {verdict})"
    )
    print(
        f"{args.steps} timed steps per candidate per repeat, {args.repeats} interleaved repeats, "
        f"after {args.warmup} warm-up steps each"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    config = gpt_config(args)
    batches = make_batches(args, args.warmup + args.steps * args.repeats)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as output_dir:
        # n_buffer 0 leaves the planner only plans that keep every chunk on the device.
        engine = quiet_initialize(build_gpt(config), job_spec(args, output_dir, n_buffer=0), batches[0])
        plan = engine.plan
        if plan.n_persist != plan.num_chunks:
            raise SystemExit(
                f"the resident plan keeps only {plan.n_persist} of {plan.num_chunks} chunks on the "
                "device; free memory or set memory.device_budget so that every chunk is persistent"
            )
        plain_model = build_gpt(config)
        num_params = sum(p.numel() for p in plain_model.parameters())
        plain = Candidate("plain PyTorch (AdamW fused)", plain_step(plain_model))
        chunks = f"{plan.num_chunks} chunk{'s' if plan.num_chunks != 1 else ''}"
        ours = Candidate(f"ProTrain (all {chunks} persistent)", protrain_step(engine))
        with engine:
            run_interleaved(
                [plain, ours], batches, steps=args.steps, repeats=args.repeats, warmup=args.warmup
            )
    header = (
        f"Overhead of the chunk engine with nothing offloaded; CPU figures (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads), fp32\n"
        f"model: GPT {args.layers} layers x width {args.width}, {num_params / 1e6:.1f}M parameters; "
        f"batch {args.batch} x {args.seq_len} tokens; chunk_size auto: {chunks} of "
        f"{plan.chunk_size / 2**20:.2f} MiB"
    )
    print_table(plain, ours, args=args, header=header)


if __name__ == "__main__":
    main()

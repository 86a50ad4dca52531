"""Soak test: a long run with SSD activation offload and periodic checkpoints must not leak.

    python scripts/soak.py                    # 1000 updates, a checkpoint every 50
    python scripts/soak.py --steps 60 --checkpoint-every 10 --sample-every 10    # CI's short one

A tiny GPT trains on one process (world size 1) with some blocks' activations in files under a
scratch directory, one block recomputed, offloaded chunks updated by CPU Adam, and a checkpoint
every ``--checkpoint-every`` updates (keep_last 2, the oldest removed as new ones land). Every
``--sample-every`` updates it records what a leak would grow: this process's open file
descriptors, the files under the run's directories (activation files, checkpoints, metrics),
the threads, and the resident set size. The samples are printed as a table; the run fails (exit
1) when, between the first sample after warm-up and the last, the descriptors, files or threads
grew at all, or the RSS by more than ``--rss-slack-mib``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from rich.console import Console
from rich.table import Table

from protrain import runtime
from protrain_demo.corpus import TokenWindows, stdlib_text_corpus
from protrain_demo.gpt import GPT, PRESETS

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Sample:
    step: int
    open_fds: int
    run_files: int
    threads: int
    rss_bytes: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--rss-slack-mib", type=float, default=64.0, help="RSS growth tolerated")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    if args.steps < 3 * args.sample_every:
        parser.error("--steps must cover at least three samples (warm-up, first, last)")
    return args


def count_files(*roots: Path) -> int:
    return sum(1 for root in roots if root.exists() for path in root.rglob("*") if path.is_file())


def sample(step: int, roots: tuple[Path, ...]) -> Sample:
    process = psutil.Process()
    return Sample(
        step=step,
        open_fds=len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else process.num_fds(),
        run_files=count_files(*roots),
        threads=threading.active_count(),
        rss_bytes=process.memory_info().rss,
    )


def job(workdir: Path, args: argparse.Namespace) -> dict[str, object]:
    return {
        "seed": 1,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3},
        "memory": {
            "chunk_size": "256KiB",
            "n_persist": 1,
            "n_buffer": 2,
            "n_checkpoint": 1,
            "ssd": {"path": str(workdir / "ssd"), "n_offload": 2},
        },
        "checkpoint": {"dir": str(workdir / "ckpt"), "interval_steps": args.checkpoint_every, "keep_last": 2},
        "output_dir": str(workdir / "runs"),
    }


def run(workdir: Path, args: argparse.Namespace) -> list[Sample]:
    torch.manual_seed(1)
    model = GPT(dataclasses.replace(PRESETS["tiny"], n_layer=4))
    engine = runtime.initialize(model, config=job(workdir, args))
    roots = (workdir / "ssd", workdir / "ckpt", workdir / "runs")
    samples: list[Sample] = []
    with engine:
        loader = engine.data_loader(TokenWindows(stdlib_text_corpus(), PRESETS["tiny"].seq_len))
        while engine.global_step < args.steps:
            for batch in loader:
                out = engine(**batch)
                engine.backward(out.loss)
                if engine.step() and engine.global_step % args.sample_every == 0:
                    samples.append(sample(engine.global_step, roots))
                if engine.global_step >= args.steps:
                    break
    samples.append(sample(engine.global_step, roots))  # after close: the run's own files are gone
    return samples


def report(samples: list[Sample], args: argparse.Namespace, console: Console) -> bool:
    table = Table(title="soak: what a leak would grow")
    for column in ("update", "open fds", "run files", "threads", "RSS MiB"):
        table.add_column(column, justify="right")
    for s in samples:
        table.add_row(
            str(s.step), str(s.open_fds), str(s.run_files), str(s.threads), f"{s.rss_bytes / MIB:.1f}"
        )
    console.print(table)
    # The first sample is warm-up (allocator pools, first checkpoints); compare the second with
    # the last one taken while training.
    first, last = samples[1], samples[-2]
    growth = {
        "open fds": last.open_fds - first.open_fds,
        "run files": last.run_files - first.run_files,
        "threads": last.threads - first.threads,
    }
    rss_growth_mib = (last.rss_bytes - first.rss_bytes) / MIB
    problems = [f"{name} grew by {value}" for name, value in growth.items() if value > 0]
    if rss_growth_mib > args.rss_slack_mib:
        problems.append(f"RSS grew by {rss_growth_mib:.1f} MiB (> {args.rss_slack_mib} MiB)")
    after_close = samples[-1]
    console.print(
        f"updates {first.step} -> {last.step}: open fds {first.open_fds} -> {last.open_fds}, run files "
        f"{first.run_files} -> {last.run_files}, threads {first.threads} -> {last.threads}, RSS "
        f"{first.rss_bytes / MIB:.1f} -> {last.rss_bytes / MIB:.1f} MiB ({rss_growth_mib:+.1f} MiB, "
        f"ratio {last.rss_bytes / first.rss_bytes:.3f}); after close: {after_close.open_fds} open fds, "
        f"{after_close.threads} threads"
    )
    if problems:
        console.print("soak: FAILED: " + "; ".join(problems))
        return False
    console.print("soak: no growth")
    return True


def main() -> int:
    args = parse_args()
    console = Console()
    if args.workdir is not None:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        return 0 if report(run(workdir, args), args, console) else 1
    with tempfile.TemporaryDirectory(prefix="protrain-soak-") as scratch:
        return 0 if report(run(Path(scratch), args), args, console) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""What each block-wise activation mode costs and saves: every block in one mode (keep, swap,
checkpoint, ssd) against keeping every activation, on the same engine, model and batches.

    .venv/bin/python scripts/bench_activations.py            # GPT 12 x 768, batch 4 x 512, fp32
    .venv/bin/python scripts/bench_activations.py --smoke    # one tiny step of each (a test)
    .venv/bin/python scripts/bench_activations.py --ssd-path /mnt/nvme/scratch
    .venv/bin/python scripts/bench_activations.py --modes keep,ssd,ssd:7   # ssd on blocks 0-6 only

The default model is GPT-2-124M's shape (12 blocks, width 768, 12 heads, 512 positions) with a
byte-level vocabulary of 256 instead of 50257, so it has 85M parameters, not 124M: the blocks,
whose activations this measures, are GPT-2's; the logits (which no block mode touches) are small.

Every engine keeps all chunks persistent (``n_buffer: 0``), so model state never moves and the
modes differ only in where activations live. Per engine, per mode:

- step time: ``--warmup`` untimed steps, then ``--repeats`` interleaved repeats (order alternating)
  of ``--steps`` timed steps; the median and its range, and the ratio to keep-all;
- activation peak: in one extra, untimed step, the C heap in use (glibc ``mallinfo2``) sampled by
  a polling thread every ``--sample-ms`` and at every block's forward entry and exit, less its
  value just before the forward (model state, gradients and optimizer state are allocated by
  then, so what remains is activations and operator temporaries). On CPU this is the device tier
  measured from outside the runtime: host-tier swap copies live in ``MmapArena`` mappings and the
  SSD staging buffers in an anonymous mmap, neither of which malloc sees. Not RSS: buffered I/O
  and the page cache would count there. On CUDA, ``torch.cuda.max_memory_allocated`` instead;
- exposed I/O: the seconds the training thread waited for activation transfers (reads in
  backward, room among the writes in flight in forward; ``ActivationStats.wait_s``);
- disk: bytes the process wrote and read (``/proc/self/io``, which counts O_DIRECT I/O and not
  page-cache hits) per step, the rate the I/O threads achieved while busy, and the same
  filesystem's raw O_DIRECT rates measured in this run (``measure_disk_rates``).

CPU figures: without CUDA the "device" is host RAM, a swap is a memcpy and the side stream and the
I/O threads share the cores that compute uses. What the ratios show is what the engine's
scheduling exposes on this machine, not what a GPU with a PCIe link and an NVMe drive would see.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_common import SEED, Batch, add_model_arguments, build_gpt, gpt_config, make_batches

from protrain import runtime
from protrain.runtime.hw.device import malloc_in_use_bytes
from protrain.runtime.hw.ssd_io import measure_disk_rates
from protrain.runtime.training.engine import Engine

MODES = ("keep", "swap", "checkpoint", "ssd")
LR = 3e-4
# Targets of the activation issue: ssd cuts the activation peak by at least this share ...
SSD_PEAK_CUT_TARGET = 0.47
# ... at no more than this step time against keep-all; swap the same.
STEP_RATIO_TARGET = 1.05


@dataclass
class ModeRun:
    """One engine, its blocks in ``mode`` (a --modes label), and what was measured of it."""

    mode: str
    engine: Engine
    step_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    disk_written: list[int] = field(default_factory=list)
    disk_read: list[int] = field(default_factory=list)
    steal_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    steps_taken: int = 0
    last_loss: float = float("nan")

    def one_step(self, batches: Sequence[Batch]) -> None:
        out = self.engine(**batches[self.steps_taken % len(batches)])
        self.engine.backward(out.loss)
        self.engine.step()
        self.steps_taken += 1
        self.last_loss = float(out.loss.detach())

    def timed(self, batches: Sequence[Batch], num_steps: int) -> None:
        stats = self.engine.activations.stats
        wait_before = stats.wait_s
        io_before = process_io()
        steal_before = stolen_cpu_seconds()
        start = time.perf_counter()
        for _ in range(num_steps):
            self.one_step(batches)
        self.step_s.append((time.perf_counter() - start) / num_steps)
        io_after = process_io()
        self.steal_s.append((stolen_cpu_seconds() - steal_before) / num_steps)
        self.wait_s.append((self.engine.activations.stats.wait_s - wait_before) / num_steps)
        self.disk_written.append((io_after[0] - io_before[0]) // num_steps)
        self.disk_read.append((io_after[1] - io_before[1]) // num_steps)


def process_io() -> tuple[int, int]:
    """(bytes written, bytes read) by this process at the block layer so far: O_DIRECT I/O counts,
    page-cache hits do not."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["write_bytes"]), int(fields["read_bytes"])


def stolen_cpu_seconds() -> float:
    """CPU-seconds the hypervisor took from this virtual machine's CPUs so far (``steal`` in
    /proc/stat; 0 on bare metal). On the VMs this was measured on, disk I/O is done on the host
    with time stolen from the guest's vCPUs: an O_DIRECT writer whose own thread used 17 ms of CPU
    per 512 MB raised steal from ~0 to ~28% of both vCPUs and slowed a matmul loop by ~55%."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    steal_ticks = int(fields[8]) if len(fields) > 8 else 0
    return steal_ticks / os.sysconf("SC_CLK_TCK")


class HeapPeak:
    """The most C-heap bytes in use while active, beyond the value at start: sampled by a thread
    every ``interval_s`` and by ``sample()`` calls (block hooks)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()

    def sample(self, *_: Any) -> None:
        self.peak = max(self.peak, malloc_in_use_bytes())

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        self.base = self.peak = malloc_in_use_bytes()
        self._stop.clear()

        def poll() -> None:
            while not self._stop.wait(self.interval_s):
                self.sample()

        thread = threading.Thread(target=poll, name="bench-heap-peak", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()
            self.sample()

    @property
    def beyond_base(self) -> int:
        return self.peak - self.base


def measure_peak(run: ModeRun, batches: Sequence[Batch], sample_ms: float) -> int:
    """Activation peak of one step (see the module docstring), in bytes."""
    engine = run.engine
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run.one_step(batches)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    sampler = HeapPeak(sample_ms / 1000)
    handles = []
    for block in engine.activations.blocks:
        handles.append(block.register_forward_pre_hook(sampler.sample))
        handles.append(block.register_forward_hook(sampler.sample))
    try:
        with sampler.watching():
            run.one_step(batches)
    finally:
        for handle in handles:
            handle.remove()
    return sampler.beyond_base


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.set_defaults(layers=12, width=768, heads=12, seq_len=512, batch=4)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES))
    parser.add_argument(
        "--ssd-path", default=None, help="directory for activation files (default: a temp dir)"
    )
    parser.add_argument(
        "--device-budget",
        default="2GiB",
        help="memory.device_budget of each engine (the engines are alive at once, so none may take auto)",
    )
    parser.add_argument("--steps", type=int, default=1, help="timed steps per engine per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per engine first")
    parser.add_argument("--sample-ms", type=float, default=1.0, help="heap sampling interval")
    parser.add_argument("--disk-probe-mib", type=int, default=512, help="file size of the raw disk probe")
    parser.add_argument("--smoke", action="store_true", help="one tiny step of each (a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.heads, args.seq_len, args.batch = 2, 64, 2, 32, 2
        args.steps, args.repeats, args.warmup, args.disk_probe_mib = 1, 1, 0, 8
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = sorted(mode for mode in args.modes if not valid_mode(mode, args.layers))
    if unknown or "keep" not in args.modes:
        parser.error(
            f"--modes: {unknown or 'keep missing'}; allowed: {', '.join(MODES)}, or MODE:K for the "
            f"first K of {args.layers} blocks in MODE and the rest kept; keep required"
        )
    args.modes = ["keep"] + [mode for mode in args.modes if mode != "keep"]
    sizes = (args.layers, args.width, args.heads, args.seq_len, args.batch, args.steps, args.repeats)
    if min(sizes) < 1 or args.warmup < 0 or args.sample_ms <= 0 or args.disk_probe_mib < 1:
        parser.error("sizes, --steps, --repeats, --sample-ms, --disk-probe-mib positive; --warmup >= 0")
    return args


def valid_mode(label: str, num_blocks: int) -> bool:
    mode, _, count = label.partition(":")
    return mode in MODES and (not count or (count.isdigit() and 1 <= int(count) <= num_blocks))


def block_modes(label: str, num_blocks: int) -> list[str]:
    """``mode`` for every block, or ``mode:K``: the first K blocks in mode, the rest kept."""
    mode, _, count = label.partition(":")
    first = int(count) if count else num_blocks
    return [mode] * first + ["keep"] * (num_blocks - first)


def build_engine(args: argparse.Namespace, label: str, ssd_root: Path, output_dir: str) -> Engine:
    modes = block_modes(label, args.layers)
    memory: dict[str, Any] = {"device_budget": args.device_budget, "n_buffer": 0, "block_modes": modes}
    if "ssd" in modes:
        # One directory per engine: each mode's files are apart.
        memory["ssd"] = {"path": str(ssd_root / label.replace(":", "-"))}
    spec = {
        "seed": SEED,
        "micro_batch_size": args.batch,
        "precision": "fp32",
        "optimizer": {"lr": LR},
        "memory": memory,
        "output_dir": output_dir,
    }
    # The plan table and progress lines go to a buffer (the console binds stdout when built).
    with contextlib.redirect_stdout(io.StringIO()):
        return runtime.initialize(build_gpt(gpt_config(args)), config=spec)


def run_all(runs: Sequence[ModeRun], batches: Sequence[Batch], args: argparse.Namespace) -> None:
    for run in runs:
        for _ in range(args.warmup):
            run.one_step(batches)
    for repeat in range(args.repeats):
        for run in runs if repeat % 2 == 0 else list(reversed(runs)):
            run.timed(batches, args.steps)
    for run in runs:
        run.peak_bytes = measure_peak(run, batches, args.sample_ms)


def print_table(runs: Sequence[ModeRun], disk: tuple[float, float, str], args: argparse.Namespace) -> None:
    keep = runs[0]
    base_s = statistics.median(keep.step_s)
    base_peak = max(keep.peak_bytes, 1)
    num_params = sum(p.numel() for p in build_gpt(gpt_config(args)).parameters())
    where = "CUDA" if keep.engine.device.type == "cuda" else "CPU: the device tier is host RAM"
    print(
        f"Block-wise activation modes vs keep-all; torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, fp32, {where}\n"
        f"model: GPT {args.layers} blocks x width {args.width}, {args.heads} heads, vocab 256, "
        f"{num_params / 1e6:.1f}M parameters; batch {args.batch} x {args.seq_len} tokens; every block in "
        "the mode named (MODE:K: the first K blocks, the rest kept)"
    )
    title = (
        f"{'mode':<12}{'s/step':>8}{'min-max (s)':>16}{'ratio':>8}{'act peak MiB':>14}{'peak cut':>10}"
        f"{'exposed I/O s':>15}{'steal CPU-s':>13}{'disk MiB w/r':>15}{'write MB/s':>12}{'final loss':>12}"
    )
    print(title)
    print("-" * len(title))
    for run in runs:
        step = statistics.median(run.step_s)
        written = statistics.median(run.disk_written)
        read = statistics.median(run.disk_read)
        store = run.engine.activations.store
        rate = "-"
        if store is not None and store.stats.write_seconds > 0:
            rate = f"{store.stats.bytes_written / store.stats.write_seconds / 1e6:.0f}"
        spread = f"{min(run.step_s):.3f}-{max(run.step_s):.3f}"
        print(
            f"{run.mode:<12}{step:>8.3f}{spread:>16}{step / base_s:>7.3f}x"
            f"{run.peak_bytes / 2**20:>14.1f}{1 - run.peak_bytes / base_peak:>9.1%} "
            f"{statistics.median(run.wait_s):>14.3f}{statistics.median(run.steal_s):>13.2f}"
            f"{f'{written / 2**20:.0f}/{read / 2**20:.0f}':>15}{rate:>12}{run.last_loss:>12.5f}"
        )
    write_bps, read_bps, io_mode = disk
    print(
        f"raw disk under the ssd path ({io_mode}, {args.disk_probe_mib} MiB file): write "
        f"{write_bps / 1e6:.0f} MB/s, read {read_bps / 1e6:.0f} MB/s. write MB/s above: payload bytes "
        "per busy second of one I/O thread (the store runs two)."
    )
    for run in runs[1:]:
        stats = run.engine.activations.stats
        print(
            f"{run.mode}: {stats.records} storages sent away, {stats.dedup_hits} dedup hits, "
            f"{stats.forwarded} forwarded, {stats.served_live} served live, {stats.kept_small} kept small"
        )
    print(
        f"Medians over {args.repeats} interleaved repeats of {args.steps} step(s) after {args.warmup} "
        "warm-up step(s); activation peak from one more step (C heap beyond its value before the forward; "
        "host-tier copies and SSD staging are mmap regions outside it); disk MiB per step from "
        "/proc/self/io; steal = CPU-seconds per step the hypervisor took from this VM's CPUs (disk I/O "
        "on a VM is served with them; 0 on bare metal).\n"
        f"Targets: ssd peak cut >= {SSD_PEAK_CUT_TARGET:.0%} at <= {STEP_RATIO_TARGET}x; swap <= "
        f"{STEP_RATIO_TARGET}x; checkpoint reported."
    )
    verdicts = []
    for run in runs[1:]:
        ratio = statistics.median(run.step_s) / base_s
        cut = 1 - run.peak_bytes / base_peak
        if run.mode.startswith("ssd"):
            met = cut >= SSD_PEAK_CUT_TARGET and ratio <= STEP_RATIO_TARGET
            verdicts.append(
                f"{run.mode} {'meets' if met else 'misses'} its target (cut {cut:.1%}, {ratio:.3f}x)"
            )
        elif run.mode.startswith("swap"):
            met = ratio <= STEP_RATIO_TARGET
            verdicts.append(f"{run.mode} {'meets' if met else 'misses'} its target ({ratio:.3f}x)")
    if verdicts:
        print("; ".join(verdicts))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    batches = make_batches(args, args.warmup + args.steps * args.repeats + 1)
    with contextlib.ExitStack() as stack:
        output_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-activations-"))
        ssd_root = Path(args.ssd_path) if args.ssd_path else Path(output_dir) / "ssd"
        disk = measure_disk_rates(ssd_root, nbytes=args.disk_probe_mib << 20)
        runs = []
        for mode in args.modes:
            engine = stack.enter_context(build_engine(args, mode, ssd_root, output_dir))
            runs.append(ModeRun(mode, engine))
        run_all(runs, batches, args)
        print_table(runs, disk, args)


if __name__ == "__main__":
    main()

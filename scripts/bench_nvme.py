"""Optimizer state on NVMe (``memory.ssd.n_optimizer``) against the same training with the state
in host memory, in one process, on this machine's disk.

    .venv/bin/python scripts/bench_nvme.py                    # GPT 6 x 512 (~19M params), under /var/tmp
    .venv/bin/python scripts/bench_nvme.py --ssd-path /nvme   # another disk
    .venv/bin/python scripts/bench_nvme.py --clip             # clipping: gradients kept, in files too
    .venv/bin/python scripts/bench_nvme.py --smoke            # two tiny steps of each (a test)

Both engines offload every chunk (``n_persist: 0``, two buffers, fp32 unless ``--precision bf16``,
AdamW, no clipping: each gradient is applied as it arrives, so with the state on NVMe the host
holds 4 bytes per parameter of fp32 master, or in bf16 2 of compute copy with the master in the
files too; 12 without; ``--clip``: clipping at 1.0, so each gradient is kept until the norm is
known, in RAM 4 bytes more, with the state on NVMe in a gradient file beside it); the NVMe
engine puts every chunk's state in files. They train the
same batches, interleaved (a repeat times ``--steps`` steps of one, then of the other, the order
alternating), and must end bit-identical. Reported:

- the disk: its write and read rates where the files go, measured here the way the tier does I/O
  (O_DIRECT where the filesystem allows it; said), so the page cache cannot hold the state;
- the bytes the process moved to and from the disk per step (``/proc/self/io``: with O_DIRECT
  every byte is real disk I/O) against the plan's prediction (writes: the state, and kept
  gradients, once per step; reads: the chunks sharing a host slot, and the kept gradients but
  the two the update finds in their buffers);
- the step time of each, their ratio, and the NVMe engine's against the cost model's prediction
  at the measured rates (the target: within 20%; at least 0.5x the in-memory step where the
  disk's rate allows it);
- the optimizer state against the host regions the NVMe plan maps (arena, slots, staging).

The timed block of the NVMe engine ends after its writes are on disk (the tier drained), so no
write spills into the other engine's block.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from bench_common import add_model_arguments, build_gpt, derive_chunk_size, gpt_config, make_batches

from protrain import runtime
from protrain.profiler.host_bytes import NVME_GRADIENT_BUFFERS, NVME_SLOTS, nvme_file_bytes, nvme_tensor_bytes
from protrain.runtime.hw.ssd_io import measure_disk_rates

TARGET_PREDICTION = 0.20
TARGET_RATIO = 0.5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=4, help="timed blocks of each engine, interleaved")
    parser.add_argument("--chunks", type=int, default=12, help="at least this many chunks")
    parser.add_argument("--ssd-path", default=None, help="where the state files go (default: a folder in /var/tmp)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: the masters go too")
    parser.add_argument("--clip", action="store_true", help="clip gradients at 1.0 (they are kept: in files too)")
    parser.add_argument("--smoke", action="store_true", help="two tiny steps of each (a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.heads, args.seq_len, args.batch = 2, 64, 2, 32, 2
        args.steps, args.repeats = 1, 2
    return args


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused to be fetched from and sent to storage."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def spec(args: argparse.Namespace, chunk_size: int, out: Path, nvme: int) -> dict[str, Any]:
    memory: dict[str, Any] = {
        "chunk_size": chunk_size,
        "n_persist": 0,
        "n_buffer": 2,
        "n_swap": "auto",
        "n_checkpoint": 0,
    }
    if nvme:
        memory["ssd"] = {"path": str(out / "nvme"), "n_offload": 0, "n_optimizer": nvme}
    return {
        "seed": 1,
        "micro_batch_size": args.batch,
        "precision": args.precision,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        "gradient_clipping": 1.0 if args.clip else 0.0,
        "memory": memory,
        "profiler": {"cache_dir": str(out / "cache")},
        "output_dir": str(out / f"runs-{nvme}"),
    }


def expected_reads(engine: Any) -> int:
    """Bytes an update reads back: the NVMe chunks that share a host slot (chunk i of n uses slot
    i mod min(3, n)), each its whole state file; kept gradients but those of the first two
    chunks the update reaches (their buffers still hold them)."""
    nvme = engine.chunks.store.tiers.nvme
    chunks = [chunk for chunk in engine.chunks.chunks if chunk.state_on_nvme]
    slots = min(NVME_SLOTS, len(chunks))
    sharing = [sum(1 for i in range(len(chunks)) if i % slots == slot) for slot in range(slots)]
    states = sum(
        nvme_file_bytes(chunk.master.numel(), nvme.tensors) for i, chunk in enumerate(chunks) if sharing[i % slots] > 1
    )
    if nvme.gradients is None:
        return states
    return states + sum(nvme_tensor_bytes(chunk.master.numel()) for chunk in chunks[NVME_GRADIENT_BUFFERS:])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    root = (
        Path(args.ssd_path) if args.ssd_path else Path(tempfile.mkdtemp(prefix="protrain-bench-nvme-", dir="/var/tmp"))
    )
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        write_bps, read_bps, mode = measure_disk_rates(root, nbytes=(16 if args.smoke else 256) << 20)
        print(f"disk under {root}: write {write_bps / 1e6:,.0f} MB/s, read {read_bps / 1e6:,.0f} MB/s ({mode})")
        model_config = gpt_config(args)
        chunk_size = derive_chunk_size(build_gpt(model_config), args.chunks)
        batches = make_batches(args, 1 + args.steps * args.repeats)
        with contextlib.redirect_stdout(io.StringIO()):
            ram = runtime.initialize(
                build_gpt(model_config), config=spec(args, chunk_size, out, 0), example_batch=batches[0]
            )
            trainable = sum(1 for chunk in ram.chunks.chunks if chunk.training is not None)
            spec_nvme = spec(args, chunk_size, out, trainable)
            spec_nvme["memory"]["ssd"]["path"] = str(root)
            nvme = runtime.initialize(build_gpt(model_config), config=spec_nvme, example_batch=batches[0])
        tier = nvme.chunks.store.tiers.nvme
        assert tier is not None
        engines = {"in memory": ram, "on NVMe": nvme}
        times: dict[str, list[float]] = {name: [] for name in engines}
        io_per_step: list[tuple[int, int]] = []
        for engine in engines.values():  # warm-up: one untimed step each
            step(engine, batches[0])
        tier.drain()
        for repeat in range(args.repeats):
            order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
            for name in order:
                engine = engines[name]
                window = batches[1 + repeat * args.steps : 1 + (repeat + 1) * args.steps]
                before = proc_io()
                started = time.perf_counter()
                for batch in window:
                    step(engine, batch)
                if engine is nvme:
                    tier.drain()  # its writes are on disk before the other engine's block
                times[name].append((time.perf_counter() - started) / len(window))
                if engine is nvme:
                    after = proc_io()
                    io_per_step.append(((after[0] - before[0]) // len(window), (after[1] - before[1]) // len(window)))
        identical = all(
            torch.equal(a, b) for a, b in zip(ram.state_dict().values(), nvme.state_dict().values(), strict=True)
        )
        report(args, ram, nvme, times, io_per_step, expected_reads(nvme), identical, (write_bps, read_bps))
        ram.close()
        nvme.close()
    if not args.ssd_path:
        with contextlib.suppress(OSError):
            root.rmdir()


def step(engine: Any, batch: dict[str, torch.Tensor]) -> None:
    out = engine(**batch)
    engine.backward(out.loss)
    engine.step()


def report(
    args: argparse.Namespace,
    ram: Any,
    nvme: Any,
    times: dict[str, list[float]],
    io_per_step: list[tuple[int, int]],
    reads_expected: int,
    identical: bool,
    rates: tuple[float, float],
) -> None:
    tier = nvme.chunks.store.tiers.nvme
    plan = nvme.plan
    medians = {name: statistics.median(values) for name, values in times.items()}
    params = sum(p.numel() for p in ram.module.parameters()) / 1e6
    chunks = f"{plan.num_chunks} chunks of {plan.chunk_size / 2**20:.2f} MiB"
    clipped = ", clipped (gradients kept)" if args.clip else ""
    print(f"model: GPT {args.layers} x {args.width}, {params:.1f}M parameters, {chunks}, all offloaded{clipped}")
    state = tier.file_bytes
    host = nvme.chunks.host_bytes()
    print(f"optimizer state on NVMe: {state / 2**20:.1f} MiB; host regions of the NVMe plan: {host / 2**20:.1f} MiB "
          f"({state / host:.2f}x; in memory the plan maps {ram.chunks.host_bytes() / 2**20:.1f} MiB)")  # fmt: skip
    for name, values in times.items():
        print(f"{name:10s} step {medians[name]:.3f} s (range {min(values):.3f}-{max(values):.3f})")
    ratio = medians["in memory"] / medians["on NVMe"]
    print(f"NVMe step / in-memory step: {1 / ratio:.2f}x (in-memory speed kept: {ratio:.2f}, target >= {TARGET_RATIO})")
    if plan.predicted_step_s:
        error = medians["on NVMe"] / plan.predicted_step_s - 1
        print(f"cost model: NVMe step predicted {plan.predicted_step_s:.3f} s, measured {medians['on NVMe']:.3f} s "
              f"({error:+.0%}; target within {TARGET_PREDICTION:.0%}) at write {rates[0] / 1e6:,.0f}, "
              f"read {rates[1] / 1e6:,.0f} MB/s")  # fmt: skip
    reads = statistics.median(r for r, _ in io_per_step)
    writes = statistics.median(w for _, w in io_per_step)
    predicted = plan.predicted_nvme_bytes or 0
    mib = 2**20
    print(
        f"disk bytes per step (/proc/self/io, O_DIRECT: {tier.direct_io}): written {writes / mib:.2f} MiB "
        f"(predicted {predicted / mib:.2f}, the files {tier.file_bytes / mib:.2f}), "
        f"read {reads / mib:.2f} MiB (expected {reads_expected / mib:.2f})"
    )
    print(f"final weights bit-identical: {identical}")
    if not identical:
        raise SystemExit("the NVMe run's state differs from the in-memory run's")


if __name__ == "__main__":
    main()

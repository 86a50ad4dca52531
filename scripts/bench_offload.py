"""What offloading every chunk costs: ProTrain with ``n_persist=0`` and the fewest device buffers
the engine accepts vs the same engine with every chunk persistent, and where the extra time goes.

    .venv/bin/python scripts/bench_offload.py            # GPT 6 x 512, batch 4 x 256 tokens, fp32
    .venv/bin/python scripts/bench_offload.py --smoke    # one tiny step of each (a test)

CPU figures: on a machine without CUDA the "device" is host RAM too and the side stream is one
worker thread, so a transfer is a memcpy competing with compute for the same cores and memory
bandwidth, not a PCIe copy beside it; so does the CPU-Adam thread. The ratios say what the
engine's scheduling exposes, not what a GPU would see.

All engines are built from the same weights and train in fp32 on the same batches, with a chunk
size that splits the model into at least ``--min-chunks`` chunks. The offloaded engine gets the
smallest ``memory.n_buffer`` that ``runtime.initialize`` accepts (tried upwards from 1; the engine
refuses fewer buffers than one module's own parameters span). With one buffer nothing can be
prefetched (the engine prefetches ``n_buffer - 1`` chunks ahead), so a second offloaded engine
with ``--extra-buffers`` more buffers shows what prefetch hides (0 leaves it out). As in
``bench_overhead``, each engine takes ``--warmup`` untimed steps, then every repeat times
``--steps`` steps of each, the engines interleaved and their order alternating.

Per step, besides the wall time of forward + backward + update, the main thread's time is split
by wrapping methods of the engine's ``ChunkManager`` and of its parts (instance attributes set
here; no runtime file changes). Each instant is counted once, in the innermost wrapped call:

- transfer wait: in ``ensure_resident`` (waiting for a prefetched chunk, or gathering one on the
  spot) and ``drain`` (waiting for gradient reductions still queued on the side stream): the
  transfer time that was not overlapped with compute;
- optimizer: in ``ChunkManager.step`` (and ``finish_speculation`` / ``discard_speculation`` where
  the engine has them): persistent chunks are updated there, after backward, so in full; offloaded
  chunks are updated speculatively on the CPU-Adam thread during backward, so what shows here is
  only the wait for that thread, the update time not overlapped;
- refresh: in ``refresh_full_copies`` (re-gathering persistent chunks from their updated masters,
  dropping stale buffered copies);
- the rest: forward and backward compute and the engine's bookkeeping (including the cores that
  the side-stream and CPU-Adam threads take from compute).

The table gives medians over repeats of the per-step means, the step time's range, and the
gathers (chunk uploads into buffers) per step.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from bench_common import (
    SEED,
    Batch,
    add_model_arguments,
    build_gpt,
    derive_chunk_size,
    gpt_config,
    make_batches,
)

from protrain import runtime
from protrain.profiler.plan import UpdateMode
from protrain.runtime.chunks.manager import ChunkManager
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.training.engine import Engine

LR = 3e-4
WEIGHT_DECAY = 0.1

TRANSFER = "transfer wait"
OPTIMIZER = "optimizer"
REFRESH = "refresh"
CATEGORIES = (TRANSFER, OPTIMIZER, REFRESH)
# ChunkManager methods timed, and what their own (exclusive) time counts as.
TIMED_METHODS = {
    "ensure_resident": TRANSFER,
    "drain": TRANSFER,
    "step": OPTIMIZER,
    "refresh_full_copies": REFRESH,
}
# Timed when the engine has them: waits for (or undoing of) the speculative CPU Adam.
OPTIONAL_METHODS = {"finish_speculation": OPTIMIZER, "discard_speculation": OPTIMIZER}
# Methods the manager's parts also call among themselves are wrapped on the part that owns them
# (an instance attribute there is what those calls find).
OWNING_PART = {"ensure_resident": "residency", "drain": "collectives"}


class ExclusiveTimer:
    """Seconds per category on the main thread. A timed call made inside another (``step`` ->
    ``refresh_full_copies`` -> ``drain``) pauses the outer one, so categories never overlap and
    their sum never exceeds the wall time."""

    def __init__(self) -> None:
        self.totals_s: defaultdict[str, float] = defaultdict(float)
        self._stack: list[tuple[str, float]] = []
        self._main = threading.get_ident()

    def wrap(self, owner: object, method: str, category: str) -> None:
        original = getattr(owner, method)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            # Only the main thread's waiting is exposed time; the side stream's is overlap.
            if threading.get_ident() != self._main:
                return original(*args, **kwargs)
            self._enter(category)
            try:
                return original(*args, **kwargs)
            finally:
                self._exit()

        # An instance attribute shadows the method, and the manager and its parts call their own
        # methods through ``self``, so internal calls are timed too.
        setattr(owner, method, timed)

    def _enter(self, category: str) -> None:
        now = time.perf_counter()
        if self._stack:
            outer, since = self._stack[-1]
            self.totals_s[outer] += now - since
        self._stack.append((category, now))

    def _exit(self) -> None:
        now = time.perf_counter()
        category, since = self._stack.pop()
        self.totals_s[category] += now - since
        if self._stack:
            self._stack[-1] = (self._stack[-1][0], now)

    def take(self) -> dict[str, float]:
        """The totals since the last call, and a fresh start."""
        totals = {category: self.totals_s.get(category, 0.0) for category in CATEGORIES}
        self.totals_s.clear()
        return totals


@dataclass
class Config:
    """One engine under test, with its per-repeat means (seconds per step, gathers per step)."""

    name: str
    engine: Engine
    timer: ExclusiveTimer
    step_s: list[float] = field(default_factory=list)
    parts_s: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})
    gathers: list[float] = field(default_factory=list)
    speculated: list[float] = field(default_factory=list)
    """Chunk updates made on the CPU-Adam thread during backward, per step."""
    steps_taken: int = 0
    last_loss: float = float("nan")

    def instrument(self) -> None:
        chunks = self.engine.chunks
        for method, category in TIMED_METHODS.items():
            owner = getattr(chunks, OWNING_PART[method]) if method in OWNING_PART else chunks
            self.timer.wrap(owner, method, category)
        for method, category in OPTIONAL_METHODS.items():
            if hasattr(chunks, method):
                self.timer.wrap(chunks, method, category)
        if hasattr(chunks, "optimizer"):
            # The wait for the host worker (CPU Adam, gradient adds) wherever it is drained.
            self.timer.wrap(chunks.optimizer, "drain", OPTIMIZER)

    def run(self, batches: Sequence[Batch], num_steps: int, *, record: bool) -> None:
        engine = self.engine
        self.timer.take()
        gathers_before = engine.chunks.num_gathers
        speculated_before = num_speculations(engine.chunks)
        start = time.perf_counter()
        for _ in range(num_steps):
            out = engine(**batches[self.steps_taken])
            engine.backward(out.loss)
            engine.step()
            self.steps_taken += 1
            self.last_loss = float(out.loss.detach())
        # A two-phase step leaves its offloaded updates running into the next forward: the
        # block's last ones are this engine's time, not the next engine's.
        engine.chunks.drain()
        elapsed = time.perf_counter() - start
        parts = self.timer.take()
        if not record:
            return
        self.step_s.append(elapsed / num_steps)
        for category in CATEGORIES:
            self.parts_s[category].append(parts[category] / num_steps)
        self.gathers.append((engine.chunks.num_gathers - gathers_before) / num_steps)
        self.speculated.append((num_speculations(engine.chunks) - speculated_before) / num_steps)

    def median(self, category: str) -> float:
        return statistics.median(self.parts_s[category])


def num_speculations(chunks: ChunkManager) -> int:
    """Speculative CPU-Adam updates so far (0 for an engine without them)."""
    return int(getattr(chunks, "num_speculations", 0))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--min-chunks", type=int, default=8, help="split the model into at least this many")
    parser.add_argument("--chunk-size", type=int, default=None, help="bytes per chunk (default: derived)")
    parser.add_argument(
        "--extra-buffers", type=int, default=1, help="a second offloaded engine with this many more buffers"
    )
    parser.add_argument(
        "--compare-deferred",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the minimum-buffer plan with CPU Adam deferred to the window's end",
    )
    parser.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="gradient_clipping of every engine (a clipped window never updates early: on CPU every "
        "update is deferred to the step); > 0 adds the minimum-buffer plan with the two-phase step "
        "(offloaded updates after the norm, overlapping the next forward; the default on CUDA)",
    )
    parser.add_argument(
        "--device-budget",
        default="2GiB",
        help="memory.device_budget of each engine (the engines are alive at once, so none may take auto)",
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per engine per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per engine first")
    parser.add_argument("--smoke", action="store_true", help="one tiny step of each (a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.heads, args.seq_len, args.batch = 2, 64, 2, 32, 2
        args.steps, args.repeats, args.warmup = 1, 1, 0
    sizes = (args.layers, args.width, args.heads, args.seq_len, args.batch, args.min_chunks)
    if min(*sizes, args.steps, args.repeats) < 1 or min(args.warmup, args.extra_buffers, args.clip) < 0:
        parser.error(
            "sizes, --min-chunks, --steps and --repeats must be positive, --warmup and --extra-buffers >= 0"
        )
    return args


NEVER_CLIPS = 1e30
"""A gradient_clipping no gradient norm reaches: updates as without clipping, gradients kept."""


def job_spec(
    args: argparse.Namespace, output_dir: str, memory: dict[str, Any], *, clip: float | None = None
) -> dict[str, Any]:
    return {
        "seed": SEED,
        "micro_batch_size": args.batch,
        "precision": "fp32",
        "optimizer": {"lr": LR, "weight_decay": WEIGHT_DECAY},
        "gradient_clipping": args.clip if clip is None else clip,
        "memory": {"device_budget": args.device_budget, **memory},
        "output_dir": output_dir,
    }


def quiet_initialize(args: argparse.Namespace, config: dict[str, Any], batch: Batch) -> Engine:
    """``runtime.initialize`` with the plan table and progress lines sent to a buffer (the
    engine's console binds stdout when it is built)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return runtime.initialize(build_gpt(gpt_config(args)), config=config, example_batch=batch)


def offloaded_engine(
    args: argparse.Namespace,
    output_dir: str,
    chunk_size: int,
    batch: Batch,
    *,
    first_n_buffer: int,
    clip: float | None = None,
) -> Engine:
    """``n_persist=0`` with the fewest buffers from ``first_n_buffer`` up that ``initialize``
    accepts (jumping straight to the minimum when the refusal names one); ``clip`` in place of
    ``--clip``."""
    n_buffer = first_n_buffer
    while True:
        memory = {"chunk_size": chunk_size, "n_persist": 0, "n_buffer": n_buffer}
        try:
            return quiet_initialize(args, job_spec(args, output_dir, memory, clip=clip), batch)
        except SpecError as err:
            if "n_buffer" not in str(err):
                raise
            named = re.search(r"n_buffer >= (\d+)", str(err))
            n_buffer = max(n_buffer + 1, int(named.group(1)) if named else 0)


def run_interleaved(configs: Sequence[Config], batches: Sequence[Batch], args: argparse.Namespace) -> None:
    for config in configs:
        config.run(batches, args.warmup, record=False)
    for repeat in range(args.repeats):
        for config in configs if repeat % 2 == 0 else list(reversed(configs)):
            config.run(batches, args.steps, record=True)


def print_table(configs: Sequence[Config], *, header: str, args: argparse.Namespace) -> None:
    """One row per engine, ratios against the first (all persistent); then, per offloaded engine,
    what it costs beyond the first."""
    resident = configs[0]
    base = statistics.median(resident.step_s)
    print(header)
    title = (
        f"{'engine':<31}{'s/step':>8}{'min-max (s)':>16}{'ratio':>8}{'transfer wait':>15}"
        f"{'optimizer':>11}{'refresh':>9}{'rest':>8}{'gathers':>9}{'final loss':>12}"
    )
    print(title)
    print("-" * len(title))
    for config in configs:
        step = statistics.median(config.step_s)
        parts = [config.median(category) for category in CATEGORIES]
        spread = f"{min(config.step_s):.4f}-{max(config.step_s):.4f}"
        print(
            f"{config.name:<31}{step:>8.4f}{spread:>16}{step / base:>7.3f}x{parts[0]:>15.4f}"
            f"{parts[1]:>11.4f}{parts[2]:>9.4f}{step - sum(parts):>8.4f}"
            f"{statistics.median(config.gathers):>9.1f}{config.last_loss:>12.5f}"
        )
    for config in configs[1:]:
        print(
            f"{config.name}: {statistics.median(config.step_s) - base:+.4f} s/step vs all persistent; "
            f"exposed transfer wait {config.median(TRANSFER) - resident.median(TRANSFER):+.4f} s/step, "
            f"exposed optimizer {config.median(OPTIMIZER):.4f} s/step (all persistent: "
            f"{resident.median(OPTIMIZER):.4f}) with {statistics.median(config.speculated):.0f} chunk "
            "updates per step made during backward"
        )
    print(
        "Seconds per step, medians over repeats; rest = forward + backward compute and bookkeeping; "
        "gathers = chunk uploads into buffers per step.\n"
        f"{args.steps} timed steps per engine per repeat, {args.repeats} interleaved repeats, after "
        f"{args.warmup} warm-up steps each. CPU figures: the device is host RAM, the side stream and "
        "the CPU-Adam thread share the same cores as compute."
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    batches = make_batches(args, args.warmup + args.steps * args.repeats)
    chunk_size = args.chunk_size or derive_chunk_size(build_gpt(gpt_config(args)), args.min_chunks)
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as output_dir, contextlib.ExitStack() as stack:
        # n_buffer 0 leaves the planner only plans that keep every chunk on the device.
        resident = quiet_initialize(
            args, job_spec(args, output_dir, {"chunk_size": chunk_size, "n_buffer": 0}), batches[0]
        )
        stack.enter_context(resident)
        plan = resident.plan
        if plan.num_chunks < args.min_chunks:
            raise SystemExit(
                f"chunk size {chunk_size} B gives {plan.num_chunks} chunks, fewer than "
                f"--min-chunks {args.min_chunks}; pass a smaller --chunk-size"
            )
        if plan.n_persist != plan.num_chunks:
            raise SystemExit(
                f"only {plan.n_persist} of {plan.num_chunks} chunks fit the device budget; free memory "
                "so that the baseline keeps every chunk persistent"
            )
        configs = [Config(f"all persistent ({plan.num_chunks} chunks)", resident, ExclusiveTimer())]
        minimum = offloaded_engine(args, output_dir, chunk_size, batches[0], first_n_buffer=1)
        offloaded = [minimum]
        if args.extra_buffers:
            n_buffer = minimum.plan.n_buffer + args.extra_buffers
            more = offloaded_engine(args, output_dir, chunk_size, batches[0], first_n_buffer=n_buffer)
            offloaded.append(more)
        if args.compare_deferred:
            # The same minimum-buffer plan with every CPU Adam update deferred to the end of the
            # window instead of made as gradients arrive. Deferring keeps the gradients until the
            # step: without --clip a clip no norm reaches keeps them (the same updates), and on
            # CPU a clipped window defers.
            deferred = offloaded_engine(
                args, output_dir, chunk_size, batches[0], first_n_buffer=1, clip=args.clip or NEVER_CLIPS
            )
            deferred.switch_plan(dataclasses.replace(deferred.plan, update_mode=UpdateMode.DEFERRED))
            offloaded.append(deferred)
        if args.clip > 0:
            # The same minimum-buffer plan with the two-phase step (runtime/chunks/optimizer.py).
            two_phase = offloaded_engine(args, output_dir, chunk_size, batches[0], first_n_buffer=1)
            two_phase.switch_plan(dataclasses.replace(two_phase.plan, update_mode=UpdateMode.TWO_PHASE))
            offloaded.append(two_phase)
        for engine in offloaded:
            stack.enter_context(engine)
            label = " (minimum)" if engine.plan.n_buffer == minimum.plan.n_buffer else ""
            if engine.plan.update_mode is UpdateMode.TWO_PHASE:
                label += ", two-phase"
            elif engine.plan.update_mode is UpdateMode.DEFERRED:
                label += ", CPU Adam deferred"
            name = f"offload, n_buffer={engine.plan.n_buffer}{label}"
            configs.append(Config(name, engine, ExclusiveTimer()))
        for config in configs:
            config.instrument()
        run_interleaved(configs, batches, args)
    num_params = sum(p.numel() for p in build_gpt(gpt_config(args)).parameters())
    header = (
        f"Offloading every chunk vs keeping every chunk persistent; CPU figures (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads), fp32\n"
        f"model: GPT {args.layers} layers x width {args.width}, {num_params / 1e6:.1f}M parameters; batch "
        f"{args.batch} x {args.seq_len} tokens; {plan.num_chunks} chunks of {chunk_size / 2**20:.2f} MiB; "
        "offload = n_persist=0"
        + (f"; gradient_clipping {args.clip:g} on every engine" if args.clip > 0 else "")
    )
    print_table(configs, header=header, args=args)


if __name__ == "__main__":
    main()

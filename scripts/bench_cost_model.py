"""How well the cost model predicts: predicted vs measured step time and peak device memory of
hand-set plans on two GPT models, the search's speed, and what profiling a model costs.

    .venv/bin/python scripts/bench_cost_model.py            # GPT 4 x 256 and 8 x 384, batch 4 x 256, fp32
    .venv/bin/python scripts/bench_cost_model.py --smoke    # tiny models, one plan each, one step (a test)

One process, world size 1, on whatever device ``runtime.initialize`` selects (CPU here: the
"device" tier is the C heap, the host tier the engine's mmap arenas). Targets on CPU: mean
step-time error <= 10%, mean peak-memory error <= 4%; search <= 0.06 s for the paper's four knobs
(n_persist, n_buffer, n_swap, n_checkpoint) on an 80-block model and <= 0.5 s for the six-knob
space (those and chunk_size, ssd.n_offload); profiling the model <= 3x the chosen plan's step
time. The script prints "met" or "NOT met" beside each target and never fails on a number.

Method, per model:

1. Profile. ``runtime.initialize`` with an example batch and ``memory.chunk_size`` set (so the
   model splits into at least ``--min-chunks`` chunks), ``n_persist``/``n_buffer`` "auto":
   it profiles the model and the machine and the search chooses the plan. ``profile_model`` and
   ``hardware_profile`` are passed to it wrapped (``runtime.planning.planner.Profilers``) to keep the
   profiles they return and time them. That engine is
   closed at once; every plan, the chosen one included, is then built alike (step 2).
2. Plans. The chosen plan and up to four hand-set ones at the same chunk size: all chunks
   persistent; half persistent with the fewest buffers; nothing persistent with the fewest
   buffers; nothing persistent with two more (prefetch). Each is built by ``initialize`` with all
   three of ``memory.chunk_size``/``n_persist``/``n_buffer`` set, so the engine runs exactly that
   plan, and its prediction is ``profiler.cost_model.predict`` for exactly those knobs over the
   step-1 profiles (with every knob set, ``initialize`` neither profiles nor predicts; these are
   the numbers it puts in a plan it searches, checked for the chosen plan).
3. Measure, ``--repeats`` rounds; each round takes every plan in turn (the order alternating
   from round to round, so that drift of the machine hits all plans alike), one engine alive at
   a time (so that only its state is in the heap): ``gc.collect()`` and ``malloc_trim(0)``, then
   the baseline ``malloc_in_use_bytes()``; build the model and the engine; ``--warmup`` untimed
   steps; ``--steps`` timed steps (forward, backward and update, each timed on the host; on CPU
   every op is synchronous); close the engine. The measured step time is the median over rounds
   of the per-step mean; the noise is the coefficient of variation (stdev / mean) of those
   per-round means (so it includes rebuilding the engine), and the measured peak the largest
   of the rounds' peaks (their spread is reported too).

Peak device memory, measured: the largest ``malloc_in_use_bytes()`` (glibc ``mallinfo2``: bytes
in use in every malloc arena plus malloc's mmapped blocks) read at every module's forward hook
and at every trainable parameter's post-accumulate-grad hook (after the engine's own hook has
moved the gradient into its chunk) during the timed steps, minus the baseline. So it counts
everything the C heap holds beyond the baseline at those instants: persistent chunks (compute
copy, fp32 master shard, gradient shard, Adam moments), chunk buffers, gradient buffers, saved
activations, temporaries alive at a hook, the batch, the engine's small tensors and bookkeeping,
and what the CPU-Adam and side-stream threads allocate meanwhile. Not counted: the host tier
(mmap arenas), Python objects (pymalloc arenas are mmapped), thread stacks, and peaks between
hooks (inside one operator, the loss, the optimizer update after backward). A reading costs about
a microsecond; there are roughly (modules + parameters) readings per step.

Predicted peak: ``Prediction.peak_device_bytes`` (a searched plan's
``predicted_peak_device_bytes``) = persistent chunks + buffers + saved activations + the larger
of the transient peak seen by the profiler (which reads the same counter at the same hooks) and
one chunk's gradient buffer. Errors are (predicted - measured) / measured; the summary gives the
mean of their absolute values and the worst one.

Also reported: ``profiler.search.search`` on Llama-2-70B's 80 blocks, analytically (as in
tests/unit/test_cost_model.py) with an NVMe disk, seconds (median of ``--search-repeats``, the
layout enumeration included) and plans evaluated, for the paper's four knobs (at one chunk size)
and for all six. And the cost of profiling: the
wrapped ``profile_model`` call's seconds (``profiler.warmup_steps`` + ``profile_steps``
instrumented forward/backward steps) over the measured step time of the plan the search chose,
plus the hardware probes (measured on the first model, cached in the temporary
``profiler.cache_dir`` for the second).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import io
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_common import SEED, Batch, build_gpt, derive_chunk_size, make_batches

from protrain import runtime
from protrain.profiler.activation_cost import activation_options
from protrain.profiler.analytic import KNOWN_CONFIGS, analytic_profile, shape_from_config
from protrain.profiler.cost_model import Prediction, chunk_costs, predict
from protrain.profiler.profile import HardwareProfile, ModelProfile
from protrain.profiler.search import search
from protrain.runtime.commands.what_if import machine_from_file
from protrain.runtime.config.hardware_spec import load_hardware
from protrain.runtime.config.settings import keeps_gradients
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.hw.device import malloc_in_use_bytes
from protrain_demo.gpt import GPTConfig
from protrain.runtime.planning.hardware_probes import hardware_profile
from protrain.runtime.planning.model_profiling import profile_model
from protrain.runtime.planning.profilers import Profilers
from protrain.runtime.training.engine import Engine

LR = 3e-4
WEIGHT_DECAY = 0.1
ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

TARGET_STEP_ERROR = 0.10
TARGET_PEAK_ERROR = 0.04
TARGET_SEARCH_FOUR_S = 0.06
TARGET_SEARCH_SIX_S = 0.5
TARGET_PROFILE_RATIO = 3.0
BUSY_CORES = 0.2
"""Average cores kept busy by other processes above which the timings are flagged."""

PAPER_KNOBS = ("n_persist", "n_buffer", "n_swap", "n_checkpoint")
ALL_KNOBS = ("chunk_size", "n_persist", "n_buffer", "n_swap", "n_checkpoint", "n_offload")

ALL_PERSISTENT = "all persistent"
HALF_MIN = "half persistent, min buffers"
OFFLOAD_MIN = "offload all, min buffers"
OFFLOAD_MORE = "offload all, +2 buffers"
PLAN_KINDS = (ALL_PERSISTENT, HALF_MIN, OFFLOAD_MIN, OFFLOAD_MORE)
SMOKE_KINDS = ((ALL_PERSISTENT,), (OFFLOAD_MIN,))
"""--smoke: the plans of each model (one each; the second exercises the offloaded paths)."""


# ------------------------------------------------------------------------------------- setup


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    width: int
    heads: int

    @property
    def name(self) -> str:
        return f"GPT {self.layers}x{self.width}"

    def config(self, seq_len: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=256, seq_len=seq_len, n_layer=self.layers, n_head=self.heads, d_model=self.width
        )


def parse_shape(text: str) -> ModelShape:
    """``LAYERSxWIDTH`` or ``LAYERSxWIDTHxHEADS`` (heads default: width / 64, at least 1)."""
    try:
        numbers = [int(part) for part in text.lower().split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LAYERSxWIDTH[xHEADS]") from None
    if len(numbers) not in (2, 3) or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not LAYERSxWIDTH[xHEADS] of positive integers")
    heads = numbers[2] if len(numbers) == 3 else max(1, numbers[1] // 64)
    if numbers[1] % heads:
        raise argparse.ArgumentTypeError(f"{text!r}: width {numbers[1]} is not a multiple of {heads} heads")
    return ModelShape(numbers[0], numbers[1], heads)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models",
        type=lambda text: [parse_shape(part) for part in text.split(",")],
        default=[ModelShape(4, 256, 4), ModelShape(8, 384, 6)],
        help="comma-separated LAYERSxWIDTH[xHEADS] (default 4x256x4,8x384x6)",
    )
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=4, help="samples per step")
    parser.add_argument("--min-chunks", type=int, default=8, help="split each model into at least this many")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per plan")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per plan first")
    parser.add_argument("--search-repeats", type=int, default=5, help="timed runs of the 80-block search")
    parser.add_argument("--smoke", action="store_true", help="tiny models, one plan each, one step (a test)")
    args = parser.parse_args(argv)
    args.kinds = [PLAN_KINDS] * len(args.models)
    if args.smoke:
        args.models = [ModelShape(2, 64, 2), ModelShape(2, 96, 2)]
        args.kinds = list(SMOKE_KINDS)
        args.seq_len, args.batch, args.min_chunks = 32, 2, 4
        args.steps, args.repeats, args.warmup, args.search_repeats = 1, 1, 0, 1
    sizes = (args.seq_len, args.batch, args.min_chunks, args.steps, args.repeats, args.search_repeats)
    if min(sizes) < 1 or args.warmup < 0:
        parser.error(
            "sizes, --min-chunks, --steps, --repeats, --search-repeats must be positive, --warmup >= 0"
        )
    return args


def job_spec(
    args: argparse.Namespace, output_dir: str, cache_dir: str, memory: dict[str, Any]
) -> dict[str, Any]:
    return {
        "seed": SEED,
        "micro_batch_size": args.batch,
        "precision": getattr(args, "precision", "fp32"),  # the GPU check runs these in bf16
        "optimizer": {"lr": LR, "weight_decay": WEIGHT_DECAY},
        "memory": memory,
        "profiler": {"cache_dir": cache_dir},
        "output_dir": output_dir,
    }


def update_case(args: argparse.Namespace) -> dict[str, bool]:
    """How the jobs of ``job_spec`` update (no clipping, no accumulation; fp16 would scale the
    loss), as ``predict`` must be told: offloaded gradients are applied as they arrive."""
    fp16 = getattr(args, "precision", "fp32") == "fp16"
    kept = keeps_gradients(gradient_clipping=0.0, loss_scaled=fp16, accumulation_steps=1)
    return {"updates_after_norm": fp16, "keeps_gradients": kept}


def quiet_initialize(
    config: GPTConfig, spec: dict[str, Any], batch: Batch, profilers: Profilers | None = None
) -> Engine:
    """``runtime.initialize`` on a freshly built model, with the plan table and the progress
    lines sent to a buffer (the engine's console binds stdout when it is built)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return runtime.initialize(build_gpt(config), config=spec, example_batch=batch, profilers=profilers)


def release_heap() -> None:
    """Collect garbage and hand free heap pages back (so the baseline starts from a quiet heap)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --------------------------------------------------------------------------------- profiling


@dataclass
class Profiled:
    """What step 1 gave for one model: the profiles and the plan the search chose."""

    model: ModelProfile
    hardware: HardwareProfile
    chunk_size: int
    chosen: tuple[int, int]
    """(n_persist, n_buffer) the search chose."""
    chosen_prediction: tuple[float | None, int | None]
    """The chosen plan's (predicted_step_s, predicted_peak_device_bytes) as initialize set them."""
    rule: str
    model_profile_s: float
    hardware_profile_s: float
    initialize_s: float


def capture_profiles(record: dict[str, tuple[Any, float]]) -> Profilers:
    """``profile_model`` and ``hardware_profile`` wrapped to keep each one's result and seconds
    under "model" / "hardware"."""

    def timed(original: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = original(*args, **kwargs)
            record[key] = (result, time.perf_counter() - started)
            return result

        return wrapper

    return Profilers(model=timed(profile_model, "model"), hardware=timed(hardware_profile, "hardware"))


def profile(
    config: GPTConfig, args: argparse.Namespace, dirs: tuple[str, str], chunk_size: int, batch: Batch
) -> Profiled:
    record: dict[str, tuple[Any, float]] = {}
    spec = job_spec(args, *dirs, {"chunk_size": chunk_size})
    started = time.perf_counter()
    engine = quiet_initialize(config, spec, batch, capture_profiles(record))
    initialize_s = time.perf_counter() - started
    with engine:
        plan = engine.plan
    if "model" not in record or "hardware" not in record:
        raise SystemExit(f"initialize did not profile the model (plan rule: {plan.rule})")
    del engine
    release_heap()
    return Profiled(
        model=record["model"][0],
        hardware=record["hardware"][0],
        chunk_size=plan.chunk_size,
        chosen=(plan.n_persist, plan.n_buffer),
        chosen_prediction=(plan.predicted_step_s, plan.predicted_peak_device_bytes),
        rule=plan.rule,
        model_profile_s=record["model"][1],
        hardware_profile_s=record["hardware"][1],
        initialize_s=initialize_s,
    )


# ------------------------------------------------------------------------------- measurement


@dataclass
class PlanRun:
    """One plan of one model: its prediction and what was measured."""

    model: str
    label: str
    n_persist: int
    n_buffer: int
    num_chunks: int
    chosen: bool
    prediction: Prediction
    step_s: list[float] = field(default_factory=list)
    """Per repeat: mean seconds per step (forward + backward + update)."""
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    """Per repeat: the largest heap reading minus the baseline, bytes."""
    samples: list[float] = field(default_factory=list)
    """Per repeat: heap readings per step."""
    initialize_s: list[float] = field(default_factory=list)
    predicted_for: tuple[int, int] = (0, 0)
    """The (n_persist, n_buffer) ``prediction`` is for."""

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks)

    @property
    def peak_spread(self) -> float:
        """(largest - smallest) / largest of the per-repeat peaks."""
        return (max(self.peaks) - min(self.peaks)) / max(max(self.peaks), 1)

    @property
    def name(self) -> str:
        return f"{self.model}: {self.label}{' *' if self.chosen else ''}"

    @property
    def knobs(self) -> str:
        return f"p={self.n_persist}/{self.num_chunks} b={self.n_buffer}"

    @property
    def measured_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def cv(self) -> float | None:
        if len(self.step_s) < 2:
            return None
        return statistics.stdev(self.step_s) / statistics.fmean(self.step_s)

    @property
    def step_error(self) -> float:
        return self.prediction.step_s / self.measured_s - 1.0

    def phase_errors(self) -> tuple[float, float, float]:
        """predicted / measured - 1 of forward, backward and update (medians over repeats)."""
        p = self.prediction
        # What the model adds beyond forward and backward: Adam (the CPU part where it does not
        # overlap), the gradient-norm and zeroing passes, the refresh of persistent chunks.
        update_s = p.step_s - p.forward_s - p.backward_s
        measured = (statistics.median(part) for part in (self.forward_s, self.backward_s, self.update_s))
        return tuple(  # type: ignore[return-value]
            predicted / max(got, 1e-12) - 1.0
            for predicted, got in zip((p.forward_s, p.backward_s, update_s), measured, strict=True)
        )

    @property
    def peak_error(self) -> float:
        return self.prediction.peak_device_bytes / max(self.peak_bytes, 1) - 1.0


class PeakProbe:
    """The largest C-heap reading at every module's forward hook and every trainable parameter's
    post-accumulate-grad hook, while ``active``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.active = False
        self.peak = 0
        self.samples = 0
        self._handles: list[Any] = []
        for module in model.modules():
            self._handles.append(module.register_forward_hook(lambda *_: self.sample()))
        for param in model.parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(lambda _: self.sample()))

    def sample(self) -> None:
        if self.active:
            self.samples += 1
            self.peak = max(self.peak, malloc_in_use_bytes())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def build_engine(config: GPTConfig, spec: dict[str, Any], batch: Batch) -> Engine:
    """The engine for exactly the spec's knobs; when the engine refuses ``n_buffer`` as too few
    buffers for one module's chunks, the fewest it names (the cost model's count may differ)."""
    memory = spec["memory"]
    while True:
        try:
            return quiet_initialize(config, spec, batch)
        except SpecError as err:
            text = str(err)
            if "n_buffer >=" not in text:
                raise
            need = int(text.split("n_buffer >=")[1].split()[0].strip(".,;"))
            if need <= memory["n_buffer"]:
                raise
            print(f"note: the engine refused n_buffer={memory['n_buffer']}; using its minimum {need}")
            memory["n_buffer"] = need


def measure_once(
    run: PlanRun,
    config: GPTConfig,
    spec: dict[str, Any],
    batches: Sequence[Batch],
    args: argparse.Namespace,
) -> None:
    """One repeat: build the plan's engine on a fresh model, warm up, time ``--steps`` steps while
    sampling the heap, close it; appends to ``run``."""
    release_heap()
    baseline = malloc_in_use_bytes()
    started = time.perf_counter()
    engine = build_engine(config, spec, batches[0])
    run.initialize_s.append(time.perf_counter() - started)
    plan = engine.plan
    run.n_persist, run.n_buffer, run.num_chunks = plan.n_persist, plan.n_buffer, plan.num_chunks
    probe = PeakProbe(engine.module)
    with engine:
        for index in range(args.warmup):
            one_step(engine, batches[index])
        probe.active = True
        totals = [0.0, 0.0, 0.0]
        for index in range(args.warmup, args.warmup + args.steps):
            for part, seconds in enumerate(one_step(engine, batches[index])):
                totals[part] += seconds
        probe.active = False
    probe.remove()
    run.forward_s.append(totals[0] / args.steps)
    run.backward_s.append(totals[1] / args.steps)
    run.update_s.append(totals[2] / args.steps)
    run.step_s.append(sum(totals) / args.steps)
    run.peaks.append(probe.peak - baseline)
    run.samples.append(probe.samples / args.steps)
    del engine, probe, plan
    release_heap()


def one_step(engine: Engine, batch: Batch) -> tuple[float, float, float]:
    """Seconds of forward, backward and update."""
    started = time.perf_counter()
    out = engine(**batch)
    forwarded = time.perf_counter()
    engine.backward(out.loss)
    backwarded = time.perf_counter()
    engine.step()
    return forwarded - started, backwarded - forwarded, time.perf_counter() - backwarded


def plan_knobs(kind: str, num_chunks: int, need: Sequence[int]) -> tuple[int, int]:
    """(n_persist, n_buffer) of one hand-set plan kind; ``need[p]``: fewest buffers at n_persist p."""
    if kind == ALL_PERSISTENT:
        return num_chunks, 0
    if kind == HALF_MIN:
        p = num_chunks // 2
        return p, need[p]
    if kind == OFFLOAD_MIN:
        return 0, need[0]
    if kind == OFFLOAD_MORE:
        return 0, min(need[0] + 2, num_chunks)
    raise ValueError(f"unknown plan kind {kind!r}")


def run_model(
    shape: ModelShape, kinds: Sequence[str], args: argparse.Namespace, dirs: tuple[str, str]
) -> tuple[list[PlanRun], Profiled, int]:
    config = shape.config(args.seq_len)
    batches = make_batches(
        argparse.Namespace(seq_len=args.seq_len, batch=args.batch), args.warmup + args.steps
    )
    chunk_size = derive_chunk_size(build_gpt(config), args.min_chunks)
    profiled = profile(config, args, dirs, chunk_size, batches[0])
    costs = chunk_costs(profiled.model, profiled.hardware, profiled.chunk_size)
    n = costs.num_chunks
    wanted: list[tuple[str, int, int]] = [(kind, *plan_knobs(kind, n, costs.need)) for kind in kinds]
    if not args.smoke and all((p, b) != profiled.chosen for _, p, b in wanted):
        wanted.insert(0, ("chosen by search", *profiled.chosen))
    runs: list[PlanRun] = []
    specs: list[dict[str, Any]] = []
    for label, p, b in wanted:
        run = PlanRun(
            model=shape.name,
            label=label,
            n_persist=p,
            n_buffer=b,
            num_chunks=n,
            chosen=(p, b) == profiled.chosen,
            prediction=predict(
                profiled.model, profiled.hardware, costs, n_persist=p, n_buffer=b, **update_case(args)
            ),
            predicted_for=(p, b),
        )
        if run.chosen:
            check_same(run.prediction, profiled.chosen_prediction, run.name)
        runs.append(run)
        memory = {"chunk_size": profiled.chunk_size, "n_persist": p, "n_buffer": b}
        specs.append(job_spec(args, *dirs, memory))
    # Repeats interleave the plans, in alternating order, so that drift of the machine hits all alike.
    for repeat in range(args.repeats):
        order = list(zip(runs, specs, strict=True))
        for run, spec in order if repeat % 2 == 0 else reversed(order):
            measure_once(run, config, spec, batches, args)
            if (run.n_persist, run.n_buffer) != run.predicted_for:  # the engine asked for more buffers
                run.predicted_for = (run.n_persist, run.n_buffer)
                run.prediction = predict(
                    profiled.model,
                    profiled.hardware,
                    costs,
                    n_persist=run.n_persist,
                    n_buffer=run.n_buffer,
                    **update_case(args),
                )
    num_params = sum(numel for numel, _ in profiled.model.param_sizes)
    return runs, profiled, num_params


def check_same(prediction: Prediction, from_plan: tuple[float | None, int | None], name: str) -> None:
    """The recomputed prediction of the chosen plan should be the one initialize put in it."""
    step_s, peak = from_plan
    if step_s is None or peak is None:
        print(f"note: {name}: initialize's plan carries no prediction")
    elif not math.isclose(step_s, prediction.step_s, rel_tol=1e-9) or peak != prediction.peak_device_bytes:
        print(
            f"note: {name}: initialize predicted {step_s:.4f} s, {peak / MIB:.2f} MiB; "
            f"recomputed {prediction.step_s:.4f} s, {prediction.peak_device_bytes / MIB:.2f} MiB"
        )


# ------------------------------------------------------------------------------------ search


def eighty_block_profile() -> tuple[ModelProfile, HardwareProfile]:
    """Llama-2-70B's shape (80 blocks) as an analytic bf16 profile of batch 1 x 2048, on the
    machine of configs/hardware/h100-80gb.yaml (as in tests/unit/test_cost_model.py)."""
    machine = machine_from_file(load_hardware(ROOT / "configs" / "hardware" / "h100-80gb.yaml"))
    shape = shape_from_config(KNOWN_CONFIGS["llama-2-70b"], name="llama-2-70b")
    model = analytic_profile(
        shape, micro_batch_size=1, seq_len=2048, precision="bf16", sustained_flops=machine.sustained_flops
    )
    return model, machine.hardware


@dataclass(frozen=True, slots=True)
class SearchTiming:
    knobs: str
    """"four" (the paper's: n_persist, n_buffer, n_swap, n_checkpoint at one chunk size) or "six"."""
    budget_bytes: int
    seconds: float
    evaluated: int
    best: str


NVME_WRITE_BYTES_PER_S = 3e9
NVME_READ_BYTES_PER_S = 6e9
"""An NVMe drive for the six-knob search (the H100 file describes none)."""


def time_search(repeats: int) -> list[SearchTiming]:
    """The 80-block search at two device budgets (the H100's 76 GiB, where memory binds, and
    4 TiB, where everything fits: the most plans); the median seconds of ``repeats`` runs, with
    the H100 file's 2 TiB host. The paper's four knobs at the chunk size the six-knob search
    picks at that budget, and all six (with an NVMe disk for ssd); the activation layouts are
    enumerated inside the timed region."""
    model, hardware = eighty_block_profile()
    hardware = dataclasses.replace(
        hardware, ssd_write_bytes_per_s=NVME_WRITE_BYTES_PER_S, ssd_read_bytes_per_s=NVME_READ_BYTES_PER_S
    )
    timings = []
    for budget in (76 << 30, 4 << 40):
        chunk_size = None
        for knobs, ssd in (("six", True), ("four", False)):
            seconds = []
            for _ in range(repeats):
                started = time.perf_counter()
                layouts = activation_options(model, hardware, ssd=ssd, n_offload=None if ssd else 0)
                result = search(
                    model,
                    hardware,
                    device_budget=budget,
                    host_budget=2 << 40,
                    chunk_size=None if knobs == "six" else chunk_size,
                    activation_layouts=layouts,
                )
                seconds.append(time.perf_counter() - started)
            best = result.best
            chunk_size = best.chunk_size
            modes = best.block_modes or ()
            managed = ", ".join(f"{modes.count(m)} {m}" for m in ("swap", "checkpoint", "ssd") if m in modes)
            managed = managed or "all kept"
            timings.append(
                SearchTiming(
                    knobs=knobs,
                    budget_bytes=budget,
                    seconds=statistics.median(seconds),
                    evaluated=result.evaluated,
                    best=f"chunk {best.chunk_size / MIB:.0f} MiB, n_persist "
                    f"{best.n_persist}/{best.num_chunks}, n_buffer {best.n_buffer}, blocks: {managed}",
                )
            )
    return timings


# ------------------------------------------------------------------------------------ report


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def pct(value: float) -> str:
    return f"{value * 100:+.1f}"


def print_tables(runs: Sequence[PlanRun]) -> None:
    width = max(len(run.name) for run in runs) + 2
    title = (
        f"{'plan':<{width}}{'knobs':<14}{'pred s':>8}{'meas s':>8}{'err %':>8}{'CV %':>7}"
        f"{'pred MiB':>10}{'meas MiB':>10}{'err %':>8}"
    )
    print(title)
    print("-" * len(title))
    for run in runs:
        cv = "-" if run.cv is None else f"{run.cv * 100:.1f}"
        print(
            f"{run.name:<{width}}{run.knobs:<14}{run.prediction.step_s:>8.4f}{run.measured_s:>8.4f}"
            f"{pct(run.step_error):>8}{cv:>7}{run.prediction.peak_device_bytes / MIB:>10.2f}"
            f"{run.peak_bytes / MIB:>10.2f}{pct(run.peak_error):>8}"
        )
    print()
    print("Where the time goes (seconds per step; predicted vs measured medians):")
    title = (
        f"{'plan':<{width}}{'fwd pred':>9}{'fwd meas':>9}{'bwd pred':>9}{'bwd meas':>9}"
        f"{'dev adam':>9}{'cpu adam':>9}{'update':>8}{'init s':>8}"
    )
    print(title)
    print("-" * len(title))
    for run in runs:
        p = run.prediction
        print(
            f"{run.name:<{width}}{p.forward_s:>9.4f}{statistics.median(run.forward_s):>9.4f}"
            f"{p.backward_s:>9.4f}{statistics.median(run.backward_s):>9.4f}{p.device_adam_s:>9.4f}"
            f"{p.cpu_adam_s:>9.4f}{statistics.median(run.update_s):>8.4f}"
            f"{statistics.median(run.initialize_s):>8.2f}"
        )
    print(
        "pred: forward, backward (transfers included), persistent-chunk Adam (dev adam) and offloaded-chunk "
        "CPU Adam (beside backward on CUDA, added to it on CPU's shared cores);\n"
        "meas: engine(**batch), engine.backward, engine.step; "
        "init s: runtime.initialize with every knob set (no profiling)."
    )
    print()
    print("Predicted peak device memory by term (MiB) vs measured:")
    title = (
        f"{'plan':<{width}}{'persist':>9}{'buffers':>9}{'grad buf':>9}{'activ':>9}{'transient':>10}"
        f"{'pred':>9}{'meas':>9}{'meas-pred':>10}"
    )
    print(title)
    print("-" * len(title))
    for run in runs:
        p = run.prediction
        terms = (p.persistent_bytes, p.buffer_bytes, p.gradient_buffer_bytes, p.activation_bytes)
        print(
            f"{run.name:<{width}}"
            + "".join(f"{term / MIB:>9.2f}" for term in terms)
            + f"{p.transient_bytes / MIB:>10.2f}{p.peak_device_bytes / MIB:>9.2f}{run.peak_bytes / MIB:>9.2f}"
            f"{(run.peak_bytes - p.peak_device_bytes) / MIB:>+10.2f}"
        )


def print_summary(runs: Sequence[PlanRun]) -> None:
    def errors(name: str, key: Callable[[PlanRun], float], target: float) -> None:
        values = [abs(key(run)) for run in runs]
        worst = max(runs, key=lambda run: abs(key(run)))
        mean = statistics.fmean(values)
        print(
            f"{name}: mean |error| {mean * 100:.1f}%, worst {pct(key(worst))}% ({worst.name}); "
            f"target mean <= {target * 100:.0f}% on CPU: {verdict(mean <= target)}"
        )

    models = len({run.model for run in runs})
    print(f"Summary over {len(runs)} plans on {models} models (error = predicted / measured - 1):")
    errors("step time", lambda run: run.step_error, TARGET_STEP_ERROR)
    errors("peak device memory", lambda run: run.peak_error, TARGET_PEAK_ERROR)
    phases = {
        "forward": [run.phase_errors()[0] for run in runs],
        "backward": [run.phase_errors()[1] for run in runs],
        "update": [run.phase_errors()[2] for run in runs],
    }
    print(
        "step time by phase, mean error: "
        + ", ".join(f"{name} {pct(statistics.fmean(values))}%" for name, values in phases.items())
        + " (update predicted = step - forward - backward: Adam, norm and zeroing passes)"
    )
    cvs = [(run.cv, run) for run in runs if run.cv is not None]
    if cvs:
        worst_cv, worst_run = max(cvs, key=lambda item: item[0])
        mean_cv = statistics.fmean(cv for cv, _ in cvs)
        print(
            f"run-to-run noise (CV of step time over repeats): mean {mean_cv * 100:.1f}%, "
            f"worst {worst_cv * 100:.1f}% ({worst_run.name})"
        )
    else:
        print("run-to-run noise (CV of step time over repeats): n/a (one repeat)")
    spread = max(runs, key=lambda run: run.peak_spread)
    print(
        f"peak memory readings across repeats: spread at most {spread.peak_spread * 100:.1f}% "
        f"({spread.name}; measured peak = the largest)"
    )


def print_search(timings: Sequence[SearchTiming]) -> None:
    print(
        "search on Llama-2-70B's 80 blocks (analytic bf16 profile, H100 machine file, NVMe "
        f"{NVME_WRITE_BYTES_PER_S / 1e9:.0f}/{NVME_READ_BYTES_PER_S / 1e9:.0f} GB/s): the paper's four knobs "
        f"({', '.join(PAPER_KNOBS)}) at one chunk size, and all six ({', '.join(ALL_KNOBS)})"
    )
    for timing in timings:
        print(
            f"  {timing.knobs} knobs, device budget {timing.budget_bytes >> 30} GiB: "
            f"{timing.evaluated} plans evaluated in {timing.seconds:.4f} s; best: {timing.best}"
        )
    four = max(t.seconds for t in timings if t.knobs == "four")
    six = max(t.seconds for t in timings if t.knobs == "six")
    print(
        f"search time: four knobs {four:.4f} s at most, target <= {TARGET_SEARCH_FOUR_S} s: "
        f"{verdict(four <= TARGET_SEARCH_FOUR_S)}; six knobs {six:.4f} s at most, target <= "
        f"{TARGET_SEARCH_SIX_S} s: {verdict(six <= TARGET_SEARCH_SIX_S)}"
    )


def print_profiling(profiles: Sequence[tuple[str, Profiled, PlanRun | None]]) -> None:
    for name, profiled, chosen in profiles:
        p, b = profiled.chosen
        if chosen is None:
            versus = f"the chosen plan (n_persist={p}, n_buffer={b}) was not measured: n/a"
        else:
            ratio = profiled.model_profile_s / chosen.measured_s
            ok = verdict(ratio <= TARGET_PROFILE_RATIO)
            versus = (
                f"{ratio:.2f}x the chosen plan's measured step ({chosen.measured_s:.4f} s, n_persist={p}, "
                f"n_buffer={b}); target <= {TARGET_PROFILE_RATIO:.0f}x: {ok}"
            )
        print(
            f"profiling {name}: model {profiled.model_profile_s:.3f} s = {versus}; hardware probes "
            f"{profiled.hardware_profile_s:.3f} s; initialize with profiling {profiled.initialize_s:.2f} s"
        )
        print(f"  plan rule: {profiled.rule}")


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process) so far; None where
    /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy, own.user + own.system


def busy_note(before: tuple[float, float] | None, after: tuple[float, float] | None, wall_s: float) -> str:
    """How many cores other processes kept busy on average while the benchmark ran, and a
    warning when that was enough to skew the timings."""
    if before is None or after is None:
        return "other processes' CPU use: unknown (no /proc/stat)"
    others = max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / max(wall_s, 1e-9)
    text = f"other processes kept {others:.2f} of {os.cpu_count()} cores busy on average during the run"
    if others > BUSY_CORES:
        text += (
            "\nwarning: the cores were shared; timings (and the profile they are predicted from) are "
            "not this machine's: run again on a quiet machine"
        )
    return text


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    cpu_before = cpu_seconds()
    runs: list[PlanRun] = []
    profiles: list[tuple[str, Profiled, PlanRun | None]] = []
    models: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-cost-model-") as root:
        dirs = (f"{root}/output", f"{root}/cache")
        for shape, kinds in zip(args.models, args.kinds, strict=True):
            model_runs, profiled, num_params = run_model(shape, kinds, args, dirs)
            runs += model_runs
            chosen = next((run for run in model_runs if run.chosen), None)
            profiles.append((shape.name, profiled, chosen))
            models.append(
                f"{shape.name} ({num_params / 1e6:.1f}M parameters, {model_runs[0].num_chunks} chunks of "
                f"{profiled.chunk_size / MIB:.2f} MiB)"
            )
    timings = time_search(args.search_repeats)
    print(
        f"Cost model: predicted vs measured; {'CPU' if not torch.cuda.is_available() else 'CUDA'} figures "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads), fp32, world size 1\n"
        f"models: {'; '.join(models)}; batch {args.batch} x {args.seq_len} tokens\n"
        f"{args.repeats} rounds over the plans, each building a fresh engine per plan: {args.warmup} "
        f"warm-up and {args.steps} timed steps; * = the plan the search chose (n_persist, n_buffer auto)"
    )
    print_tables(runs)
    samples = statistics.fmean(statistics.fmean(run.samples) for run in runs)
    print(f"peak: C-heap readings at module forward and gradient hooks, about {samples:.0f} per step")
    print()
    print_summary(runs)
    print_search(timings)
    print_profiling(profiles)
    wall_s = time.perf_counter() - started
    print(busy_note(cpu_before, cpu_seconds(), wall_s))
    print(f"total time: {wall_s:.1f} s")


if __name__ == "__main__":
    main()

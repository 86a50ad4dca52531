"""overlap (issue 17, item 3): how much of the transfer and CPU-optimizer time compute hides,
every chunk offloaded (``n_persist=0``), on a GPT-2-XL-sized model in bf16; target >= 80%.

Model: ``protrain_demo.gpt.GPT`` with GPT-2 XL's shape (48 layers, width 1600, 25 heads, vocab
50257, seq 1024, tied embeddings: 1.56 B parameters), built on the meta device and filled chunk
by chunk from ``runtime.model_io.weights.ModelInit`` (engine_runs.meta_model).

Batch, from the engine's own measurements (``choose_batch``):
1. Probe: ``runtime.initialize`` at micro-batch ``probe_batch`` with ``n_persist=0`` (the rest
   planned) profiles the model and the machine; the profiles are kept
   (``bench_cost_model.capture_profiles``) and the engine closed.
2. At the probe plan's chunk size and buffers (``profiler.cost_model.chunk_costs``): compute per
   sample ``c`` (every block's and the rest's forward + backward, over the probe batch); per
   micro-batch the side stream's transfers ``T`` (each chunk's upload in forward, again in
   backward unless still in a buffer, and its gradient's copy down, at the probed copy rates,
   with the staging downcast) and the host worker's gradient adds ``H``; per update CPU Adam
   ``A`` (probed rate and per-segment cost). Micro-batch ``m = ceil(1.25 max(T, H) / c)``, so
   each micro-batch's compute can cover its transfers and adds, within [probe, max]; then the
   least accumulation ``k`` with ``k m c >= k max(T, H) + A``: compute at least transfers plus
   CPU Adam over the update, at most ``max_accumulation``. Whether that holds within the caps is
   reported (the target is judged either way).
3. Run: ``runtime.initialize`` again at ``m`` and ``k`` (``n_persist=0``; buffers and activation
   modes planned for ``m``); one untimed update, then ``updates`` updates under
   ``torch.profiler`` (CPU and CUDA activities, every thread: the runtime labels its jobs,
   runtime/chunks/trace_labels.py; ``runtime.observability.profiling.profile_every_thread``, which
   logging.trace uses too); the Chrome trace is saved as ``overlap_trace.json.gz`` in
   the report directory.

Figures (trace_overlap.py reads them, independent of the runtime's bookkeeping; overlap_report.py
reports them): the hidden share of the transfers, of the host work (gradient adds and CPU Adam),
and of both together, the target; per chunk its gathers, gradient copies, adds and Adam (busy ms, hidden share) beside its compute
as profiled (each block's time shared among chunks by parameter elements, as the cost model
does). Beside them the runtime's own exposed waits per update (metrics.jsonl: seconds the main
thread blocked for transfers, reductions, the host worker, activations; on CUDA a wait on the
device is the compute stream's and does not show there, the trace's figure does). What bounds
the CPU Adam share: an unclipped window's updates run early on the one host-worker thread during
its last backward, so Adam can hide only behind that backward.

CPU rehearsal: a tiny GPT through the same functions, CPU activities only (compute is the main
thread's operators, transfers the side-stream labels); its shares are figures (passed None), the
target is judged on CUDA only. Whether the trace holds every chunk's labels is checked on both.

Expected time on one H100 (16 cores, 128 GiB): two initializations of about a minute each
(1.56 B parameters drawn, 25 GB of pinned host state, hardware probes, three profiling steps),
the untimed and the two traced updates 0.5-2 min depending on the batch, the trace's export
and reading under a minute: 3-5 minutes.

CPU counterparts (``CPU_COUNTERPARTS``):
- tests/unit/test_pipeline_waits.py::test_a_slow_gather_shows_as_exposed_transfer_wait
- tests/unit/test_pipeline_waits.py::test_a_slow_host_worker_shows_as_exposed_host_wait
- tests/unit/test_trace_labels.py::test_every_offloaded_chunks_jobs_are_labelled_on_worker_threads
- tests/unit/test_gpu_check_trace_overlap.py::test_cuda_trace_attributes_copies_to_chunks_and_measures_what_compute_hides
- tests/unit/test_cost_model.py::test_prefetch_hides_fetches_behind_compute
- tests/unit/test_gpu_check_script.py::test_overlap_rehearsal_reads_every_chunks_work_from_the_trace
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu_checks.common import Context, Section
from gpu_checks.engine_runs import free_memory, meta_model, quiet_initialize, update_records
from gpu_checks.overlap_report import TRACE_FILE, report_chunks, report_labels, report_shares, report_waits
from gpu_checks.trace_overlap import overlap as trace_overlap
from gpu_checks.trace_overlap import parse_trace
from protrain.runtime.observability.profiling import profile_every_thread

TRANSFER_MARGIN = 1.25


@dataclass(frozen=True, slots=True)
class Sizes:
    layers: int
    width: int
    heads: int
    vocab: int
    seq_len: int
    probe_batch: int
    max_batch: int
    max_accumulation: int
    updates: int
    chunk_size: str | None
    """None: the planner's choice."""


GPU = Sizes(
    layers=48, width=1600, heads=25, vocab=50257, seq_len=1024,
    probe_batch=2, max_batch=32, max_accumulation=8, updates=2, chunk_size=None,
)
REHEARSAL = Sizes(
    layers=2, width=64, heads=2, vocab=256, seq_len=32,
    probe_batch=2, max_batch=4, max_accumulation=2, updates=2, chunk_size="64KiB",
)


@dataclass(frozen=True, slots=True)
class BatchChoice:
    micro_batch: int
    accumulation: int
    compute_per_sample_s: float
    transfers_s: float
    host_adds_s: float
    adam_s: float

    @property
    def compute_s(self) -> float:
        """Per update."""
        return self.compute_per_sample_s * self.micro_batch * self.accumulation

    @property
    def covered_s(self) -> float:
        """Per update: what compute should cover (the side stream's or the host worker's work per
        micro-batch, whichever is longer, and CPU Adam)."""
        return self.accumulation * max(self.transfers_s, self.host_adds_s) + self.adam_s

    @property
    def condition_met(self) -> bool:
        return self.compute_s >= self.covered_s


def choose_batch(model_profile: Any, hardware: Any, plan: Any, sizes: Sizes) -> BatchChoice:
    """Micro-batch and accumulation from the probe's profiles (see the module docstring)."""
    from protrain.profiler.cost_model import chunk_costs

    costs = chunk_costs(model_profile, hardware, plan.chunk_size)
    n = costs.num_chunks
    compute = costs.fwd[n] + costs.bwd_persistent[n]
    compute += costs.unattributed_forward_s + costs.unattributed_backward_s
    per_sample = compute / model_profile.batch_shape[0]
    e = costs.element_size
    _, downcast_rate, _ = hardware.host_rates()  # on the upload thread, in host memory
    downcast = costs.shard_numel * (4 + e) / downcast_rate if e != 4 else 0.0
    fetch = costs.shard_numel * e / hardware.h2d_bytes_per_s + downcast
    uploads = n + max(0, n - plan.n_buffer)  # forward, and backward for chunks no longer in a buffer
    transfers = uploads * fetch + n * costs.shard_numel * e / hardware.d2h_bytes_per_s
    adds = costs.host_adds[n]
    adam = costs.adam_params[n] / hardware.cpu_adam_params_per_s
    adam += costs.adam_segments[n] * hardware.adam_segment_s
    side = max(transfers, adds)
    micro = min(sizes.max_batch, max(sizes.probe_batch, math.ceil(TRANSFER_MARGIN * side / per_sample)))
    spare = micro * per_sample - side
    accumulation = sizes.max_accumulation if spare <= 0 else math.ceil(adam / spare)
    return BatchChoice(
        micro_batch=micro,
        accumulation=min(sizes.max_accumulation, max(1, accumulation)),
        compute_per_sample_s=per_sample,
        transfers_s=transfers,
        host_adds_s=adds,
        adam_s=adam,
    )


def job(sizes: Sizes, scratch: Path, name: str, micro_batch: int, accumulation: int, chunk_size: Any) -> dict:
    memory: dict[str, Any] = {"n_persist": 0}
    if chunk_size is not None:
        memory["chunk_size"] = chunk_size
    return {
        "seed": 1234,
        "micro_batch_size": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "precision": "bf16",
        "optimizer": {"lr": 1e-4, "weight_decay": 0.1},
        "memory": memory,
        "profiler": {"cache_dir": str(scratch / "cache")},
        "output_dir": str(scratch / name),
    }


def batches(sizes: Sizes, micro_batch: int, accumulation: int) -> Any:
    from protrain_demo.corpus import LMBatches, stdlib_text_corpus

    return LMBatches(
        tokens=stdlib_text_corpus(), seq_len=sizes.seq_len, micro_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, world_size=1, seed=1234,
    )


def build(sizes: Sizes) -> tuple[Any, Any]:
    from protrain_demo.gpt import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=sizes.vocab, seq_len=sizes.seq_len, n_layer=sizes.layers, n_head=sizes.heads,
        d_model=sizes.width,
    )
    return meta_model(lambda: GPT(config))


def profiled_engine(
    sizes: Sizes, scratch: Path, name: str, micro_batch: int, accumulation: int, chunk_size: Any
) -> tuple[Any, dict[str, tuple[Any, float]]]:
    """An engine for the batch, and the profiles its initialize measured ("model", "hardware")."""
    from bench_cost_model import capture_profiles

    record: dict[str, tuple[Any, float]] = {}
    model, weights = build(sizes)
    example = batches(sizes, micro_batch, accumulation).batch(0, 0, 0)
    spec = job(sizes, scratch, name, micro_batch, accumulation, chunk_size)
    profilers = capture_profiles(record)
    engine = quiet_initialize(model, spec, example_batch=example, weights=weights, profilers=profilers)
    return engine, record


def train_updates(engine: Any, data: Any, updates: range) -> list[float]:
    """Losses of every micro-batch, read once per update (a read per micro-batch would make
    the host wait for the device between micro-batches, which no training loop needs)."""
    losses: list[float] = []
    for update in updates:
        window = []
        for micro in range(data.gradient_accumulation_steps):
            out = engine(**data.batch(update, micro, 0))
            engine.backward(out.loss)
            engine.step()
            window.append(out.loss.detach())
        losses += [float(loss) for loss in window]
    return losses


def engine_for(
    ctx: Context, sizes: Sizes, choice: BatchChoice, chunk_size: int
) -> tuple[Any, Any, BatchChoice]:
    """The measured run's engine and the profile its initialize took (None if it took none),
    at the chosen batch or, when that does not fit the device, at half the micro-batch and
    twice the accumulation (down to the probe's batch)."""
    from protrain.runtime.config.spec_io import SpecError

    while True:
        try:
            engine, record = profiled_engine(
                sizes, ctx.scratch, "run", choice.micro_batch, choice.accumulation, chunk_size
            )
            return engine, record.get("model", (None,))[0], choice
        except (SpecError, torch.OutOfMemoryError) as error:
            if choice.micro_batch <= sizes.probe_batch:
                raise
            smaller = dataclasses.replace(
                choice, micro_batch=max(sizes.probe_batch, choice.micro_batch // 2),
                accumulation=choice.accumulation * 2,
            )
            ctx.check(
                "batch: does not fit", None,
                f"micro-batch {choice.micro_batch}: {str(error).splitlines()[0][:200]}; trying "
                f"{smaller.micro_batch} x {smaller.accumulation}",
            )
            choice = smaller
            free_memory(ctx.device)
            for stale in (ctx.scratch / "run").glob("*"):  # one engine's metrics per directory
                shutil.rmtree(stale)


def traced(ctx: Context, run: Callable[[], None]) -> dict[str, Any]:
    """Run under the profiler; the Chrome trace saved beside the report, and read back."""
    path = ctx.out / TRACE_FILE
    with profile_every_thread(ctx.is_cuda) as prof:
        run()
        ctx.synchronize()
    prof.export_chrome_trace(str(path))
    with gzip.open(path, "rt") as trace:
        return json.load(trace)


def traced_run(ctx: Context, engine: Any, data: Any, sizes: Sizes) -> tuple[Any, list[float], dict[str, Any]]:
    """One untimed update, then ``sizes.updates`` under the profiler; the engine is closed after.
    Returns its plan, every micro-batch's loss and the trace."""
    with engine:
        losses = train_updates(engine, data, range(1))
        updates = range(1, 1 + sizes.updates)
        trace = traced(ctx, lambda: losses.extend(train_updates(engine, data, updates)))
        return engine.plan, losses, trace


def run(ctx: Context) -> None:
    sizes = REHEARSAL if ctx.rehearsal else GPU
    probe, record = profiled_engine(sizes, ctx.scratch, "probe", sizes.probe_batch, 1, sizes.chunk_size)
    with probe:
        plan = probe.plan
    del probe
    free_memory(ctx.device)
    hardware = record["hardware"][0]
    choice = choose_batch(record["model"][0], hardware, plan, sizes)
    report_choice(ctx, choice, sizes, plan)
    engine, run_profile, choice = engine_for(ctx, sizes, choice, plan.chunk_size)
    data = batches(sizes, choice.micro_batch, choice.accumulation)
    run_plan, losses, trace = traced_run(ctx, engine, data, sizes)
    del engine
    free_memory(ctx.device)
    ctx.check(
        "trains, every chunk offloaded",
        all(math.isfinite(loss) for loss in losses) and run_plan.n_persist == 0,
        f"{len(losses)} micro-batches of {choice.micro_batch}, finite losses; plan n_persist "
        f"{run_plan.n_persist}/{run_plan.num_chunks}, n_buffer {run_plan.n_buffer}, swap {run_plan.n_swap}, "
        f"checkpoint {run_plan.n_checkpoint} ({run_plan.rule or 'searched'})",
        last_loss=round(losses[-1], 4),
    )
    parts = parse_trace(trace, cuda=ctx.is_cuda, main_tid=threading.main_thread().native_id)
    shares = trace_overlap(parts)
    report_labels(ctx, parts, shares, run_plan.num_chunks)
    report_shares(ctx, shares, parts.compute_source, parts.unlabelled_copy_s)
    profile = run_profile if run_profile is not None else record["model"][0]
    report_chunks(ctx, shares, profile, hardware, run_plan.chunk_size, choice.micro_batch)
    report_waits(ctx, update_records(ctx.scratch / "run")[-sizes.updates :])


def report_choice(ctx: Context, choice: BatchChoice, sizes: Sizes, plan: Any) -> None:
    ctx.check(
        "batch: compute covers transfers + CPU Adam",
        None,
        f"micro-batch {choice.micro_batch} x accumulation {choice.accumulation} from the probe's profile "
        f"(batch {sizes.probe_batch}, chunk {plan.chunk_size / 2**20:.2f} MiB, {plan.n_buffer} buffers): "
        f"compute {choice.compute_s:.2f} s per update vs transfers/adds + Adam {choice.covered_s:.2f} s"
        + ("" if choice.condition_met else " (NOT met within the caps: the target is judged anyway)"),
        micro_batch=choice.micro_batch,
        accumulation=choice.accumulation,
        compute_per_sample_ms=round(choice.compute_per_sample_s * 1e3, 3),
        transfers_per_micro_batch_s=round(choice.transfers_s, 4),
        host_adds_per_micro_batch_s=round(choice.host_adds_s, 4),
        cpu_adam_per_update_s=round(choice.adam_s, 4),
        condition_met=choice.condition_met,
    )


CPU_COUNTERPARTS = (
    "tests/unit/test_pipeline_waits.py::test_a_slow_gather_shows_as_exposed_transfer_wait",
    "tests/unit/test_pipeline_waits.py::test_a_slow_host_worker_shows_as_exposed_host_wait",
    "tests/unit/test_trace_labels.py::test_every_offloaded_chunks_jobs_are_labelled_on_worker_threads",
    "tests/unit/test_gpu_check_trace_overlap.py::"
    "test_cuda_trace_attributes_copies_to_chunks_and_measures_what_compute_hides",
    "tests/unit/test_cost_model.py::test_prefetch_hides_fetches_behind_compute",
    "tests/unit/test_gpu_check_script.py::test_overlap_rehearsal_reads_every_chunks_work_from_the_trace",
)
"""The suite's tests that check on CPU what this section checks on the GPU."""


SECTION = Section(
    name="overlap",
    title="transfer and CPU-optimizer time hidden behind compute, every chunk offloaded (GPT-2 XL, bf16)",
    run=run,
    cpu_counterpart=", ".join(CPU_COUNTERPARTS),
)

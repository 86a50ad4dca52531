"""Stage ``overlap`` of the first-contact run: at one fixed batch (no probe engine, unlike the
overlap section), how busy the device is with every chunk offloaded, how much transfer and host
time a step exposes, and the step time against keeping every chunk on the device.

Model: ``protrain_demo.gpt.GPT`` in bf16 built on the meta device and filled chunk by chunk
(overlap.build); on the GPU GPT-2 medium's shape (24 blocks of width 1024, 16 heads, vocabulary
50257, sequence 1024: 355M parameters), micro-batch 8, 2 micro-batches per update; in the
rehearsal the overlap section's tiny GPT. Two engines in turn at that batch:

1. every chunk offloaded (``n_persist=0``; buffers and block modes planned): six untimed updates
   (the first, then the plan check's window, runtime/planning/plan_check.py, in which the memory
   counter is read at every hook: their mean time is a figure beside the timed ones), two timed
   (the device synchronized around them), then one traced with every thread profiled, saved as
   ``trace.json.gz`` (first_contact.py keeps it beside the report);
2. every chunk persistent (``n_persist`` = the first plan's chunk count, no buffers, the same
   chunk size and block modes): six untimed updates, two timed.

Figures, per update (a step): from the trace (trace_overlap.py, independent of the runtime's
bookkeeping) the device's busy share (compute's union over the traced update's wall time: on
CUDA the compute stream's kernels, on CPU the main thread's operators), the exposed transfer
time (transfer work not under compute) and the exposed host time (gradient adds and CPU Adam not
under compute); the runtime's own waits (metrics.jsonl, mean of the timed updates); the step
time of each engine and their ratio. Whether the trace holds every chunk's jobs is checked.

Expected on one H100: two initializations of 15-25 s (355M parameters drawn, 5.7 GB of pinned
host state, probes, profiling), 17 updates of about half a second, the trace's export a few
seconds: 45-65 s. The rehearsal about 6 s.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any

import torch

from gpu_checks import overlap
from gpu_checks.common import Context, Section
from gpu_checks.engine_runs import free_memory, quiet_initialize, update_records
from gpu_checks.overlap_report import report_labels, report_waits
from gpu_checks.trace_overlap import overlap as trace_overlap
from gpu_checks.trace_overlap import parse_trace
from protrain.runtime.planning.plan_check import CHECK_AFTER_UPDATES

TRACE_FILE = "trace.json.gz"
WARMUP = CHECK_AFTER_UPDATES + 1
"""Updates before the timed ones: the first (allocations, caches) and the plan check's window
(runtime/planning/plan_check.py), during which the memory counter is read at every hook."""
GPU = overlap.Sizes(
    layers=24, width=1024, heads=16, vocab=50257, seq_len=1024,
    probe_batch=8, max_batch=8, max_accumulation=2, updates=2, chunk_size=None,
)
REHEARSAL = overlap.Sizes(
    layers=2, width=64, heads=2, vocab=256, seq_len=32,
    probe_batch=2, max_batch=2, max_accumulation=2, updates=2, chunk_size="64KiB",
)
"""``max_batch`` x ``max_accumulation`` is the fixed batch; ``updates`` the timed updates."""


def engine(ctx: Context, sizes: overlap.Sizes, name: str, memory: dict[str, Any]) -> Any:
    model, weights = overlap.build(sizes)
    data = overlap.batches(sizes, sizes.max_batch, sizes.max_accumulation)
    spec = overlap.job(sizes, ctx.scratch, name, sizes.max_batch, sizes.max_accumulation, sizes.chunk_size)
    spec["memory"] = memory
    return quiet_initialize(model, spec, example_batch=data.batch(0, 0, 0), weights=weights)


def timed_updates(ctx: Context, run: Any, data: Any, updates: range) -> float:
    """Seconds per update over ``updates`` (the device synchronized around them)."""
    ctx.synchronize()
    started = time.perf_counter()
    overlap.train_updates(run, data, updates)
    ctx.synchronize()
    return (time.perf_counter() - started) / len(updates)


def traced_update(ctx: Context, run: Any, data: Any, update: int) -> tuple[dict[str, Any], float]:
    """One update under the profiler, its trace saved as ``TRACE_FILE`` (temporary file, then a
    rename: a run killed meanwhile leaves no half file); the trace and the update's wall time."""
    import gzip
    import json

    from protrain.runtime.observability.profiling import profile_every_thread

    with profile_every_thread(ctx.is_cuda) as prof:
        ctx.synchronize()
        started = time.perf_counter()
        overlap.train_updates(run, data, range(update, update + 1))
        ctx.synchronize()
        wall = time.perf_counter() - started
    tmp = ctx.out / (TRACE_FILE + ".tmp.json.gz")
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, ctx.out / TRACE_FILE)
    with gzip.open(ctx.out / TRACE_FILE, "rt") as trace:
        return json.load(trace), wall


def run(ctx: Context) -> None:
    sizes = REHEARSAL if ctx.rehearsal else GPU
    data = overlap.batches(sizes, sizes.max_batch, sizes.max_accumulation)
    offloaded = engine(ctx, sizes, "offloaded", {"n_persist": 0} | _chunk(sizes.chunk_size))
    with offloaded:
        plan = offloaded.plan
        overlap.train_updates(offloaded, data, range(1))
        window_s = timed_updates(ctx, offloaded, data, range(1, WARMUP))
        step_s = timed_updates(ctx, offloaded, data, range(WARMUP, WARMUP + sizes.updates))
        # Said before the traced update: on the first GPU run the profiler's stop outlasted the stage.
        report_untraced(ctx, sizes, plan, window_s, step_s)
        trace, traced_s = traced_update(ctx, offloaded, data, WARMUP + sizes.updates)
    del offloaded
    free_memory(ctx.device)
    parts = parse_trace(trace, cuda=ctx.is_cuda, main_tid=threading.main_thread().native_id)
    shares = trace_overlap(parts)
    report_labels(ctx, parts, shares, plan.num_chunks)
    busy = shares.compute_s / traced_s
    exposed_transfer = shares.transfers.busy_s - shares.transfers.hidden_s
    exposed_host = shares.host.busy_s - shares.host.hidden_s
    ctx.check(
        "per step: device busy share, exposed transfer and host time",
        None,
        f"traced update {traced_s:.3f} s: compute {shares.compute_s:.3f} s on {parts.compute_source} "
        f"({busy:.1%} busy); transfers {shares.transfers.busy_s:.3f} s, {exposed_transfer:.3f} s exposed; "
        f"host work {shares.host.busy_s:.3f} s, {exposed_host:.3f} s exposed"
        + ("" if ctx.is_cuda else "; CPU figures (compute is the main thread's operators)"),
        traced_step_s=round(traced_s, 4),
        device_busy_pct=round(100 * busy, 1),
        compute_s=round(shares.compute_s, 4),
        transfer_busy_s=round(shares.transfers.busy_s, 4),
        transfer_exposed_s=round(exposed_transfer, 4),
        host_busy_s=round(shares.host.busy_s, 4),
        host_exposed_s=round(exposed_host, 4),
        unlabelled_copy_s=round(parts.unlabelled_copy_s, 4),
    )
    persistent_vs_offloaded(ctx, sizes, data, plan, step_s)


def report_untraced(ctx: Context, sizes: overlap.Sizes, plan: Any, window_s: float, step_s: float) -> None:
    """The plan, the runtime's own exposed waits and the step times, from the untraced updates."""
    ctx.check(
        "batch and plan, every chunk offloaded",
        plan.n_persist == 0,
        f"micro-batch {sizes.max_batch} x {sizes.max_accumulation} of {sizes.seq_len} tokens; chunks "
        f"{plan.num_chunks} of {plan.chunk_size / 2**20:.2f} MiB, n_persist {plan.n_persist}, n_buffer "
        f"{plan.n_buffer}, swap {plan.n_swap}, checkpoint {plan.n_checkpoint}",
        micro_batch=sizes.max_batch, accumulation=sizes.max_accumulation, num_chunks=plan.num_chunks,
        n_buffer=plan.n_buffer, chunk_mib=round(plan.chunk_size / 2**20, 3),
    )
    report_waits(ctx, update_records(ctx.scratch / "offloaded")[WARMUP : WARMUP + sizes.updates])
    ctx.check(
        "step time in the plan check's window vs after it",
        None,
        f"every chunk offloaded: updates 2-{WARMUP} (the plan check reads the memory counter at every hook) "
        f"{window_s:.3f} s each, updates {WARMUP + 1}-{WARMUP + sizes.updates} {step_s:.3f} s each",
        window_step_s=round(window_s, 4),
        after_step_s=round(step_s, 4),
    )


def persistent_vs_offloaded(ctx: Context, sizes: overlap.Sizes, data: Any, plan: Any, step_s: float) -> None:
    from protrain.runtime.config.spec_io import SpecError

    modes = [mode.value for mode in plan.block_modes]
    memory: dict[str, Any] = {
        "chunk_size": plan.chunk_size, "n_persist": plan.num_chunks, "n_buffer": 0, "block_modes": modes,
    }
    if "ssd" in modes:
        memory["ssd"] = {"path": str(ctx.scratch / "ssd")}
    refused = ""
    try:
        resident = engine(ctx, sizes, "persistent", memory)
    except (SpecError, torch.OutOfMemoryError) as error:
        refused = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    if refused:
        free_memory(ctx.device)
        ctx.check("step time: offloaded vs all persistent", None, f"all persistent does not fit: {refused}",
                  offloaded_step_s=round(step_s, 4))
        return
    with resident:
        losses = overlap.train_updates(resident, data, range(WARMUP))
        resident_s = timed_updates(ctx, resident, data, range(WARMUP, WARMUP + sizes.updates))
    del resident
    free_memory(ctx.device)
    tokens = sizes.max_batch * sizes.max_accumulation * sizes.seq_len
    ctx.check(
        "step time: offloaded vs all persistent",
        None if all(math.isfinite(loss) for loss in losses) else False,
        f"per update of {tokens} tokens, mean of {sizes.updates}: every chunk offloaded {step_s:.3f} s, every "
        f"chunk persistent {resident_s:.3f} s (x{step_s / resident_s:.2f}); same batch, chunk size, block modes",
        offloaded_step_s=round(step_s, 4),
        persistent_step_s=round(resident_s, 4),
        slowdown=round(step_s / resident_s, 3),
        offloaded_tokens_per_s=round(tokens / step_s, 1),
        persistent_tokens_per_s=round(tokens / resident_s, 1),
    )


def _chunk(chunk_size: str | None) -> dict[str, Any]:
    return {} if chunk_size is None else {"chunk_size": chunk_size}


SECTION = Section(
    name="overlap",
    title="one fixed batch: device busy share, exposed transfer and host time, offloaded vs all persistent",
    run=run,
    cpu_counterpart=overlap.SECTION.cpu_counterpart,
)

"""cost_model (issue 17, item 4): predicted vs measured step time and peak device memory on three
plans: every chunk persistent, half of them offloaded, every chunk offloaded (the fewest buffers
the engine accepts each time). Targets on CUDA, per plan: |error| <= 10% for the step time and
<= 5% for the peak.

Reuses scripts/bench_cost_model.py, whose docstring gives the method: ``profile``
(``runtime.initialize`` with an example batch and ``memory.chunk_size`` set profiles the model
and the machine; the profiles are kept), ``plan_knobs`` (the three plans' ``n_persist`` and
``n_buffer``), ``profiler.cost_model.predict`` over the kept profiles for exactly those knobs,
``build_engine`` (every knob set, so the engine runs that plan and profiles nothing) and
``one_step``; rounds take every plan in turn, the order alternating, one engine alive at a time.
What differs here:

- bf16, and the activation knobs fixed to keep every block (``n_swap``, ``n_checkpoint``,
  ``ssd.n_offload`` 0), the case ``predict`` without an activation cost describes;
- the measured peak is the device's highest allocation over the timed steps minus what was
  allocated before the engine was built. On CUDA that is the allocator's
  ``max_memory_allocated``, read through ``runtime.hw.memory_counter``'s ``PeakWindow``: the
  engine's own plan check reads and resets the allocator's peak at its hooks, so a bare read
  after the steps would miss what came before the last reset (engine_runs.device_peak). On CPU
  the C heap at the same hooks, as the bench reads it;
- a step is timed from its forward to the end of ``engine.step()``, which synchronises the
  device at the update, so the step's device work is inside the time (the split into forward,
  backward and update is host time, asynchronous on CUDA: only the predicted split is reported).

Model (GPU): GPT 12 layers x width 1024 x 16 heads (vocab 256, 151 M parameters), seq 1024,
batch 8, chunks of at least an eighth of the model; three rounds, each plan 2 warm-up and 3 timed
steps. Expected time on one H100: profiling about 20 s; a round about 20 s (three engines built
from a host model, the offloaded plans' CPU Adam on one host thread, ~0.4 s per step): 1-2
minutes in all.

CPU rehearsal: a 2-layer width-64 GPT, batch 2 x 32, one round of one warm-up and one timed step;
the errors are figures (passed None): a CPU run on a shared 2-core machine says nothing about the
CUDA targets (scripts/bench_cost_model.py has the CPU ones).

CPU counterparts (``CPU_COUNTERPARTS``):
- tests/unit/test_cost_model.py::test_hand_computed_step_time_and_memory_with_two_chunks_offloaded
- tests/unit/test_cost_model.py::test_the_host_worker_adds_and_the_upload_downcast_are_counted
- tests/unit/test_memory_counter.py::test_the_profile_and_the_plan_check_read_one_counter_at_the_same_hooks
- tests/unit/test_memory_counter.py::test_on_cuda_every_open_window_gets_every_reading
- tests/unit/test_planning.py::test_measured_step_time_is_set_beside_the_prediction_in_the_metrics
- tests/unit/test_bench_cost_model_smoke.py::test_bench_cost_model_smoke
- tests/unit/test_gpu_check_script.py::test_cost_model_rehearsal_predicts_and_measures_three_plans
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpu_checks.common import Context, Section
from gpu_checks.engine_runs import allocated_bytes, device_peak, free_memory

TARGET_STEP_ERROR = 0.10
TARGET_PEAK_ERROR = 0.05
MIB = 1 << 20
PAGE = 4096


@dataclass(frozen=True, slots=True)
class Sizes:
    layers: int
    width: int
    heads: int
    seq_len: int
    batch: int
    min_chunks: int
    rounds: int
    warmup: int
    steps: int


GPU = Sizes(layers=12, width=1024, heads=16, seq_len=1024, batch=8, min_chunks=8, rounds=3, warmup=2, steps=3)
REHEARSAL = Sizes(layers=2, width=64, heads=2, seq_len=32, batch=2, min_chunks=4, rounds=1, warmup=1, steps=1)
PRECISION = "bf16"
ELEMENT_SIZE = 2


def chunk_size_for(model: Any, min_chunks: int) -> int:
    """The bench's chunk size (``derive_chunk_size`` counts fp32 bytes) for bf16 elements: the
    same number of chunks, still holding the largest parameter; a multiple of a page."""
    from bench_cost_model import derive_chunk_size

    size = derive_chunk_size(model, min_chunks) * ELEMENT_SIZE // 4
    return math.ceil(size / PAGE) * PAGE


def exact_memory(chunk_size: int, n_persist: int, n_buffer: int) -> dict[str, Any]:
    """Every knob set: the engine runs exactly this plan, every block kept."""
    return {
        "chunk_size": chunk_size, "n_persist": n_persist, "n_buffer": n_buffer,
        "n_swap": 0, "n_checkpoint": 0, "ssd": {"n_offload": 0},
    }


def measure_once(
    ctx: Context, run: Any, config: Any, spec: dict[str, Any], batches: Sequence[Any], sizes: Sizes
) -> None:
    """One round of one plan (a fresh engine), appended to ``run`` (a bench ``PlanRun``)."""
    from bench_cost_model import build_engine, one_step

    free_memory(ctx.device)
    baseline = allocated_bytes(ctx.device)
    started = time.perf_counter()
    engine = build_engine(config, spec, batches[0])
    run.initialize_s.append(time.perf_counter() - started)
    plan = engine.plan
    run.n_persist, run.n_buffer, run.num_chunks = plan.n_persist, plan.n_buffer, plan.num_chunks
    totals = [0.0, 0.0, 0.0]
    with engine:
        for index in range(sizes.warmup):
            one_step(engine, batches[index])
        ctx.synchronize()
        with device_peak(ctx.device, engine.module) as peak:
            for index in range(sizes.warmup, sizes.warmup + sizes.steps):
                for part, seconds in enumerate(one_step(engine, batches[index])):
                    totals[part] += seconds
    run.forward_s.append(totals[0] / sizes.steps)
    run.backward_s.append(totals[1] / sizes.steps)
    run.update_s.append(totals[2] / sizes.steps)
    run.step_s.append(sum(totals) / sizes.steps)
    run.peaks.append(peak() - baseline)
    del engine, plan
    free_memory(ctx.device)


def run(ctx: Context) -> None:
    import bench_cost_model as bench

    from protrain.profiler.cost_model import chunk_costs, predict

    sizes = REHEARSAL if ctx.rehearsal else GPU
    shape = bench.ModelShape(sizes.layers, sizes.width, sizes.heads)
    config = shape.config(sizes.seq_len)
    args = argparse.Namespace(batch=sizes.batch, seq_len=sizes.seq_len, precision=PRECISION)
    batches = bench.make_batches(args, sizes.warmup + sizes.steps)
    dirs = (str(ctx.scratch / "output"), str(ctx.scratch / "cache"))
    try:
        chunk_size = chunk_size_for(bench.build_gpt(config), sizes.min_chunks)
        profiled = bench.profile(config, args, dirs, chunk_size, batches[0])
    except SystemExit as stop:  # the bench stops its process there; a section must only fail
        raise RuntimeError(str(stop)) from None
    costs = chunk_costs(profiled.model, profiled.hardware, profiled.chunk_size)
    n = costs.num_chunks
    ctx.check(
        "profile", None,
        f"{shape.name}, batch {sizes.batch} x {sizes.seq_len}, {PRECISION}: {n} chunks of "
        f"{profiled.chunk_size / MIB:.2f} MiB; model profiled in {profiled.model_profile_s:.1f} s, "
        f"hardware in {profiled.hardware_profile_s:.1f} s",
        chunks=n, chunk_mib=round(profiled.chunk_size / MIB, 3),
    )
    runs, specs = [], []
    for kind in (bench.ALL_PERSISTENT, bench.HALF_MIN, bench.OFFLOAD_MIN):
        p, b = bench.plan_knobs(kind, n, costs.need)
        runs.append(bench.PlanRun(
            model=shape.name, label=kind, n_persist=p, n_buffer=b, num_chunks=n, chosen=False,
            prediction=predict(
                profiled.model, profiled.hardware, costs, n_persist=p, n_buffer=b, **bench.update_case(args)
            ),
            predicted_for=(p, b),
        ))
        specs.append(bench.job_spec(args, *dirs, exact_memory(profiled.chunk_size, p, b)))
    for round_index in range(sizes.rounds):
        order = list(zip(runs, specs, strict=True))
        for plan_run, spec in order if round_index % 2 == 0 else reversed(order):
            measure_once(ctx, plan_run, config, spec, batches, sizes)
            if (plan_run.n_persist, plan_run.n_buffer) != plan_run.predicted_for:  # more buffers were needed
                plan_run.predicted_for = (plan_run.n_persist, plan_run.n_buffer)
                plan_run.prediction = predict(
                    profiled.model, profiled.hardware, costs,
                    n_persist=plan_run.n_persist, n_buffer=plan_run.n_buffer, **bench.update_case(args),
                )
    for plan_run in runs:
        report(ctx, plan_run, sizes)


def report(ctx: Context, run: Any, sizes: Sizes) -> None:
    p = run.prediction
    cv = run.cv
    judged = ctx.is_cuda
    ctx.check(
        f"{run.label}: step time within 10%",
        abs(run.step_error) <= TARGET_STEP_ERROR if judged else None,
        f"{run.knobs}: predicted {p.step_s:.4f} s, measured {run.measured_s:.4f} s (median of "
        f"{len(run.step_s)} rounds of {sizes.steps} steps), error {run.step_error:+.1%}"
        + ("" if judged else "; CPU figures: the target is judged on CUDA"),
        predicted_s=round(p.step_s, 5),
        measured_s=round(run.measured_s, 5),
        error_pct=round(100 * run.step_error, 1),
        cv_pct=None if cv is None else round(100 * cv, 1),
        predicted_forward_s=round(p.forward_s, 5),
        predicted_backward_s=round(p.backward_s, 5),
        predicted_cpu_adam_s=round(p.cpu_adam_s, 5),
    )
    ctx.check(
        f"{run.label}: peak memory within 5%",
        abs(run.peak_error) <= TARGET_PEAK_ERROR if judged else None,
        f"{run.knobs}: predicted {p.peak_device_bytes / MIB:.1f} MiB, measured "
        f"{run.peak_bytes / MIB:.1f} MiB (largest of the rounds), error {run.peak_error:+.1%}",
        predicted_mib=round(p.peak_device_bytes / MIB, 2),
        measured_mib=round(run.peak_bytes / MIB, 2),
        error_pct=round(100 * run.peak_error, 1),
        persistent_mib=round(p.persistent_bytes / MIB, 2),
        buffers_mib=round(p.buffer_bytes / MIB, 2),
        activations_mib=round(p.activation_bytes / MIB, 2),
        transient_mib=round(p.transient_bytes / MIB, 2),
    )


CPU_COUNTERPARTS = (
    "tests/unit/test_cost_model.py::test_hand_computed_step_time_and_memory_with_two_chunks_offloaded",
    "tests/unit/test_cost_model.py::test_the_host_worker_adds_and_the_upload_downcast_are_counted",
    "tests/unit/test_memory_counter.py::"
    "test_the_profile_and_the_plan_check_read_one_counter_at_the_same_hooks",
    "tests/unit/test_memory_counter.py::test_on_cuda_every_open_window_gets_every_reading",
    "tests/unit/test_planning.py::test_measured_step_time_is_set_beside_the_prediction_in_the_metrics",
    "tests/unit/test_bench_cost_model_smoke.py::test_bench_cost_model_smoke",
    "tests/unit/test_gpu_check_script.py::test_cost_model_rehearsal_predicts_and_measures_three_plans",
)
"""The suite's tests that check on CPU what this section checks on the GPU."""


SECTION = Section(
    name="cost_model",
    title="predicted vs measured step time and peak memory on three plans (targets 10% and 5%)",
    run=run,
    cpu_counterpart=", ".join(CPU_COUNTERPARTS),
)

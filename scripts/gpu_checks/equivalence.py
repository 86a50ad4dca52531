"""Section ``equivalence``: training through ProTrain on the device equals plain PyTorch there.

The model is the repository's GPT (4 blocks of width 256, sequence 128, batch 8: 3.2M
parameters; the rehearsal: the suite's tiny GPT with 4 blocks), trained for 10 updates (3 in the
rehearsal) with AdamW (lr 1e-3, weight decay 0.1) on the same batches as plain PyTorch on the
same device. Every plan is set by hand (chunk_size, n_persist, n_buffer, block_modes), so it is
exactly the plan named, with nothing left to a search:

- fp32, by DESIGN section 6's oracle (``tests.helpers.reference_mismatches``): per tensor within
  1e-5 of plain fp32 PyTorch, or no farther from the same training in float64 than plain fp32
  PyTorch is (x10). Plans: every chunk offloaded through 2 buffers; every chunk resident; half
  the chunks offloaded; every chunk offloaded with the blocks in ssd, swap, checkpoint and keep
  (one each); half offloaded with gradient clipping at 0.05, which triggers at every update (the
  engine's pre-clip norms, from its metrics file, are all above it; on CUDA a clipped window
  takes the two-phase step, on CPU the deferred one: a figure says which ran).
- bf16 against plain PyTorch under ``torch.autocast(bf16)`` with fp32 parameters and fp32 AdamW,
  with the tolerance of tests/unit/test_mixed_precision.py: losses within 2% at every update,
  and the parameters' distance from the reference at most 10% of what the reference's training
  changed. Plans: half offloaded; every chunk offloaded with the four block modes.
- Residency, checked from outside the engine's bookkeeping: in every run, each parameter a
  module reads lies in the device buffers or a persistent chunk (a checkpointed block's
  recomputation reads private copies by design: counted, see ``training.pool_reads``). And
  under a device budget set by hand at half of what the resident plan is predicted to peak at
  (the knobs left to the search, so the plan must offload), the searched plan predicts a peak
  within the budget and on CUDA ``max_memory_allocated`` over its training steps stays within
  it (read through the engine's own counter, ``runtime.hw.memory_counter``, which resets CUDA's
  peak at its hooks). On CPU the heap is not a device: that peak is a figure. That run must
  equal plain PyTorch too.
- One run (half offloaded, the four block modes, clipping) in a child process under
  ``TORCH_CUDA_SANITIZER=1`` (set before torch is imported: ``sanitized_run.py``), which must
  report no unsynchronized access and match the fp32 oracle. The sanitizer is a dispatch mode,
  which torch keeps per thread and hands to autograd's threads: it sees the compute thread's and
  backward's kernels, not the copies our side-stream thread issues (CPU stream chaos covers
  those, tests/unit/test_stream_chaos*.py). The rehearsal runs the child without it (torch
  refuses the variable without CUDA) and records the sanitizer as skipped.

Expected time on one H100: about 2 minutes (10 engines of a few seconds each, one search with
the machine's probes, the float64 references, the sanitized child at most a minute, slowed by
the sanitizer's bookkeeping of every kernel); the rehearsal 10-16 s on 2 cores.

CPU counterparts (the same claims in the suite): tests/unit/test_chunk_engine.py (offloaded
chunks and clipped windows equal plain PyTorch; the two-phase step bit-exact), test_activations.py
(modes with offloaded chunks), test_mixed_precision.py (bf16), test_residency.py and
test_host_model_chunked.py (pool addresses, device tier within the budget and the predicted
peak), test_stream_chaos_catches.py (missing waits, the sanitizer's CPU stand-in).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpu_checks.common import Context, Section

if TYPE_CHECKING:
    from gpu_checks.training import PoolReads, Sizes

CLIP = 0.05
KEEP = ("keep",) * 4
MODES = ("ssd", "swap", "checkpoint", "keep")
BF16_LOSS_RTOL = 2e-2
BF16_UPDATE_RTOL = 0.1
"""tests/unit/test_mixed_precision.py's bf16 tolerance (a suite test keeps them equal)."""
BUDGET_FRACTION = 0.5
"""Of the resident plan's predicted peak: a budget the resident plan cannot meet."""
SANITIZER_TIMEOUT_S = 300
MIB = 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One engine run with a plan set by hand."""

    name: str
    precision: str = "fp32"
    persistent: float
    """The share of the chunks kept on the device (rounded down); the rest pass through 2
    buffers."""
    modes: tuple[str, ...] = KEEP
    clip: float = 0.0


CASES = (
    Case(name="fp32, every chunk offloaded through 2 buffers", persistent=0.0),
    Case(name="fp32, every chunk resident", persistent=1.0),
    Case(name="fp32, half the chunks offloaded", persistent=0.5),
    Case(name="fp32, blocks ssd/swap/checkpoint/keep, every chunk offloaded", persistent=0.0, modes=MODES),
    Case(name=f"fp32, clipped at {CLIP}, half the chunks offloaded", persistent=0.5, clip=CLIP),
    Case(
        name="bf16, blocks ssd/swap/checkpoint/keep, every chunk offloaded",
        precision="bf16",
        persistent=0.0,
        modes=MODES,
    ),
    Case(name="bf16, half the chunks offloaded", precision="bf16", persistent=0.5),
)
"""The first case of each precision offloads every chunk: its plan gives the chunk count the
others take their share of."""
SANITIZED = Case(name="sanitized", persistent=0.5, modes=MODES, clip=CLIP)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reference:
    """Plain PyTorch's result on the device (copied to the host): fp32 state, float64 state
    (None for bf16), the window losses."""

    state: dict[str, torch.Tensor]
    fp64: dict[str, torch.Tensor] | None
    losses: list[float]


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """One engine's training: its final state and losses, the plan, and what was measured."""

    state: dict[str, torch.Tensor]
    losses: list[float]
    plan: dict[str, Any]
    """The plan's knobs and predictions (``Plan.to_dict``)."""
    peak_bytes: int = 0
    held_before: int = 0
    """Device bytes the process held before the engine, less the math libraries' workspaces
    (which every plan counts): on CUDA ``peak_bytes`` is the allocator's absolute peak."""
    norms: list[float] | None = None
    """The pre-clip gradient norm of every update (the engine's metrics)."""
    update_mode: str = ""
    replans: int = 0


def run(ctx: Context) -> None:
    from gpu_checks import training

    if ctx.is_cuda:
        # Plain PyTorch's own default, made explicit: TF32 matmuls would put the runs 1e-3 apart.
        torch.backends.cuda.matmul.allow_tf32 = False
    size = training.sizes(ctx)
    references = {0.0: _reference(ctx, size, clip=0.0), CLIP: _reference(ctx, size, clip=CLIP)}
    autocast = _autocast_reference(ctx, size)
    tally = training.PoolReads()
    num_chunks: dict[str, int] = {}
    for case in CASES:
        memory = _memory(size, case, num_chunks.get(case.precision, 0))
        result = _train(ctx, size, case, memory, tally=tally)
        num_chunks.setdefault(case.precision, result.plan["num_chunks"])
        if case.clip:
            _judge_clipping(ctx, result)
        if case.precision == "bf16":
            _judge_bf16(ctx, case.name, result, autocast, size)
        else:
            _judge_fp32(ctx, case.name, result, references[case.clip])
    _budget_checks(ctx, size, references[0.0], tally)
    ctx.check(
        "parameters read from the device pool",
        not tally.problems,
        "every module's parameters, before and after its forward, in every run above: "
        + ("; ".join(tally.problems[:3]) or "inside the device buffers or a persistent chunk")
        + f" (reads of the private copies a recomputed block is given: {tally.private_in_recompute})",
        outside=len(tally.problems),
        private_in_recompute=tally.private_in_recompute,
    )
    _sanitized(ctx, size, _memory(size, SANITIZED, num_chunks["fp32"]), references[CLIP])


def _model(size: Sizes, cls: type[torch.nn.Module] | None = None) -> torch.nn.Module:
    """The GPT with the suite's seed-0 weights (built on the host: ``initialize`` chunks it from
    there, plain PyTorch moves it)."""
    from protrain_demo.gpt import GPT

    torch.manual_seed(0)
    return (cls or GPT)(size.model)


def _memory(size: Sizes, case: Case, num_chunks: int) -> dict[str, Any]:
    """The case's plan, every knob set by hand."""
    from gpu_checks.training import chunk_bytes

    element_size = 2 if case.precision == "bf16" else 4
    n_persist = int(case.persistent * num_chunks)
    return {
        "chunk_size": chunk_bytes(_model(size), element_size=element_size, min_chunks=8),
        "n_persist": n_persist,
        "n_buffer": 0 if num_chunks and n_persist == num_chunks else 2,
        "block_modes": list(case.modes),
    }


def _reference(ctx: Context, size: Sizes, *, clip: float) -> Reference:
    from gpu_checks.training import lm_data, on_device, to_cpu
    from tests.helpers import train_reference, train_reference_float64

    data = on_device(lm_data(size), ctx.device)
    training = {"steps": size.steps, "lr": 1e-3, "weight_decay": 0.1, "clip": clip}
    state, losses = train_reference(_model(size).to(ctx.device), data, **training)
    fp64 = train_reference_float64(_model(size).to(ctx.device), data, **training)
    return Reference(state=to_cpu(state), fp64=to_cpu(fp64), losses=losses)


def _autocast_reference(ctx: Context, size: Sizes) -> Reference:
    """Plain PyTorch under autocast(bf16): fp32 parameters, bf16 matmuls, fp32 (fused) AdamW."""
    from gpu_checks.training import lm_data, on_device, to_cpu
    from protrain_demo.gpt import GPT
    from tests.helpers import train_reference

    class AutocastGPT(GPT):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16):
                return super().forward(*args, **kwargs)

    data = on_device(lm_data(size), ctx.device)
    model = _model(size, AutocastGPT).to(ctx.device)
    state, losses = train_reference(model, data, steps=size.steps, lr=1e-3, weight_decay=0.1)
    return Reference(state=to_cpu(state), fp64=None, losses=losses)


def _workspaces(ctx: Context) -> int:
    from protrain.runtime.hw.device import DeviceInfo
    from protrain.runtime.hw.math_workspaces import library_workspace_bytes

    return library_workspace_bytes(DeviceInfo(ctx.device, "nccl" if ctx.is_cuda else "gloo"))


def _train(
    ctx: Context, size: Sizes, case: Case, memory: dict[str, Any], *, tally: PoolReads, example: bool = False
) -> Run:
    """One engine under ``memory``, trained on the reference's batches with the pool check on;
    ``example``: plan on an example batch (the search fills the knobs left auto)."""
    from gpu_checks import training
    from gpu_checks.engine_runs import allocated_bytes, free_memory
    from protrain import runtime

    out = ctx.scratch / f"run-{len(ctx.report.checks)}"
    if "ssd" in memory.get("block_modes", ()):
        memory = {**memory, "ssd": {"path": str(out / "ssd")}}
    spec = training.engine_spec(
        out,
        micro_batch=size.micro_batch,
        memory=memory,
        precision=case.precision,
        profiles=ctx.scratch / "profiles",
        gradient_clipping=case.clip,
    )
    data = training.lm_data(size)
    free_memory(ctx.device)
    workspaces = _workspaces(ctx)  # measured first: then allocated, whatever ran before
    held_before = allocated_bytes(ctx.device) - workspaces
    engine = runtime.initialize(
        _model(size), config=spec, example_batch=data.batch(0, 0, 0) if example else None
    )
    with engine:
        with training.pool_reads(engine) as found, training.device_peak(ctx.device) as peak:
            losses = training.train(engine, data, size.steps)
        chunks = engine.chunks
        mode = chunks.update_mode.value.replace("_", "-")
        result = Run(
            state=training.to_cpu(engine.state_dict()),
            losses=losses,
            plan=engine.plan.to_dict(),
            peak_bytes=peak[0],
            held_before=held_before,
            norms=training.grad_norms(out),
            update_mode=mode,
            replans=engine.replans,
        )
    tally.problems += [f"{case.name}: {p}" for p in dict.fromkeys(found.problems)]
    tally.private_in_recompute += found.private_in_recompute
    return result


def _plan_figures(run: Run) -> dict[str, Any]:
    plan = run.plan
    figures = {k: plan[k] for k in ("chunk_size", "num_chunks", "n_persist", "n_buffer")}
    figures["block_modes"] = "/".join(plan["block_modes"])
    return figures | ({"offloaded_updates": run.update_mode} if run.update_mode else {})


def _judge_fp32(ctx: Context, name: str, run: Run, reference: Reference) -> None:
    from gpu_checks.training import worst_relative
    from tests.helpers import reference_mismatches

    assert reference.fp64 is not None
    refused = reference_mismatches(run.state, reference.state, reference.fp64)
    worst = worst_relative(run.state, reference.state)
    ctx.check(
        name,
        not refused,
        f"{len(run.losses)} updates vs plain PyTorch on {ctx.device.type}, DESIGN section 6's oracle "
        "(1e-5 per tensor, else within 10x plain fp32's distance from float64); worst max|a-b|/max|b| "
        f"{worst:.2e}" + (f"; refused: {refused[0]}" if refused else ""),
        worst_relative=worst,
        refused=len(refused),
        **_plan_figures(run),
    )


def _judge_clipping(ctx: Context, run: Run) -> None:
    norms = run.norms or []
    lowest = min(norms, default=0.0)
    ctx.check(
        f"gradient clipping at {CLIP} triggers at every update",
        len(norms) == len(run.losses) and lowest > CLIP,
        f"the engine's pre-clip norms over {len(norms)} updates: lowest {lowest:.3g}, threshold {CLIP}; "
        f"offloaded chunks updated by the {run.update_mode} step",
        lowest_norm=lowest,
        updates=len(norms),
        offloaded_updates=run.update_mode,
    )


def _judge_bf16(ctx: Context, name: str, run: Run, reference: Reference, size: Sizes) -> None:
    """tests/unit/test_mixed_precision.py's measure, against autocast instead of fp32."""
    initial = _model(size)
    names = [n for n, _ in initial.named_parameters()]  # tied weights once
    start = initial.state_dict()
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(run.losses, reference.losses, strict=True))
    distance = torch.cat([(run.state[n] - reference.state[n]).flatten() for n in names]).norm()
    trained = torch.cat([(reference.state[n] - start[n]).flatten() for n in names]).norm()
    relative = (distance / trained).item()
    masters = all(run.state[n].dtype == torch.float32 for n in names)
    ctx.check(
        name,
        worst_loss <= BF16_LOSS_RTOL and relative <= BF16_UPDATE_RTOL and masters,
        f"vs plain PyTorch under autocast(bf16) + fp32 AdamW, {len(run.losses)} updates: losses within "
        f"{BF16_LOSS_RTOL:.0%} at every update (worst {worst_loss:.2%}); the parameters' distance "
        f"{relative:.2%} of what the reference's training changed (<= {BF16_UPDATE_RTOL:.0%}); "
        f"fp32 masters: {masters}",
        worst_loss_gap=worst_loss,
        update_distance=relative,
        **_plan_figures(run),
    )


def _budget_checks(ctx: Context, size: Sizes, reference: Reference, tally: PoolReads) -> None:
    """A budget set by hand that the resident plan cannot meet: the search must offload, predict
    a peak within it, and (CUDA) the training steps must stay within it."""
    from gpu_checks import training
    from protrain import runtime

    generous = 16 * 2**30 if ctx.is_cuda else 2**30
    out = ctx.scratch / "budget-probe"
    spec = training.engine_spec(
        out,
        micro_batch=size.micro_batch,
        memory={"device_budget": generous},
        profiles=ctx.scratch / "profiles",
    )
    example = training.lm_data(size).batch(0, 0, 0)
    with runtime.initialize(_model(size), config=spec, example_batch=example) as engine:
        plan = engine.plan
    if not plan.all_resident:
        # The search is timed: on a busy machine it may find offloading no slower even with room
        # to spare. The resident plan's peak is what the budget is set from: ask for it by hand.
        memory = {"device_budget": generous, "chunk_size": plan.chunk_size, "n_persist": plan.num_chunks}
        spec = training.engine_spec(out, micro_batch=size.micro_batch, memory=memory, profiles=ctx.scratch / "profiles")
        with runtime.initialize(_model(size), config=spec, example_batch=example) as engine:
            plan = engine.plan
    resident_peak, resident = plan.predicted_peak_device_bytes, plan.all_resident
    if resident_peak is None or not resident:
        detail = (
            f"no resident prediction to set a budget from (predicted {resident_peak}, resident {resident})"
        )
        ctx.check("searched plan offloads to fit a hand-set budget", False, detail)
        return
    # Half of what the model itself takes: the math libraries' workspaces stay whatever the plan.
    workspaces = _workspaces(ctx)
    budget = workspaces + int(BUDGET_FRACTION * (resident_peak - workspaces))
    # The same profile cache: the probe's profiles are read, not measured again.
    case = Case(name="the searched plan under a hand-set budget", persistent=0.0)
    result = _train(ctx, size, case, {"device_budget": budget}, tally=tally, example=True)
    predicted = result.plan["predicted_peak_device_bytes"]
    ctx.check(
        "searched plan offloads to fit a hand-set budget",
        predicted is not None
        and predicted <= budget
        and result.plan["n_persist"] < result.plan["num_chunks"],
        f"budget {budget / MIB:.1f} MiB, set by hand at {BUDGET_FRACTION:.0%} of the resident plan's "
        f"predicted peak {resident_peak / MIB:.1f} MiB; the plan predicts {(predicted or 0) / MIB:.1f} MiB",
        budget_bytes=budget,
        resident_predicted_bytes=resident_peak,
        predicted_bytes=predicted,
        replans=result.replans,
        **_plan_figures(result),
    )
    detail = (
        f"{result.peak_bytes / MIB:.1f} MiB over {size.steps} training updates, budget {budget / MIB:.1f} MiB"
    )
    if ctx.is_cuda:
        engine_peak = result.peak_bytes - result.held_before
        ctx.check(
            "max_memory_allocated within the hand-set budget",
            engine_peak <= budget,
            f"{engine_peak / MIB:.1f} MiB over {size.steps} training updates (the allocator's peak "
            f"{result.peak_bytes / MIB:.1f} MiB less the {result.held_before / MIB:.1f} MiB the process held "
            f"before the engine), budget {budget / MIB:.1f} MiB with the math libraries' workspaces "
            f"{workspaces / MIB:.1f} MiB (predicted {(predicted or 0) / MIB:.1f} MiB)",
            peak_bytes=engine_peak,
            allocator_peak_bytes=result.peak_bytes,
            held_before_bytes=result.held_before,
            workspace_bytes=workspaces,
            budget_bytes=budget,
            predicted_bytes=predicted,
        )
    else:
        ctx.check(
            "device peak under the hand-set budget (CPU: a figure)",
            None,
            detail + " (the C heap's growth at the engine's readings: the heap is no device)",
            peak_bytes=result.peak_bytes,
            budget_bytes=budget,
        )
    _judge_fp32(ctx, "fp32, the searched plan under the hand-set budget", result, reference)


def _sanitized(ctx: Context, size: Sizes, memory: dict[str, Any], reference: Reference) -> None:
    """The clipped, half-offloaded run with every block mode, in a child process: under
    TORCH_CUDA_SANITIZER=1 on CUDA, plainly in a rehearsal (torch refuses the variable without
    CUDA); the child's state is judged here by the fp32 oracle."""
    from gpu_checks import training
    from gpu_checks.sanitized_run import run_in_child

    out = ctx.scratch / "sanitized"
    spec = training.engine_spec(
        out,
        micro_batch=size.micro_batch,
        memory={**memory, "ssd": {"path": str(out / "ssd")}},
        gradient_clipping=SANITIZED.clip,
    )
    job = {"model": asdict(size.model), "micro_batch": size.micro_batch, "steps": size.steps, "spec": spec}
    if not ctx.is_cuda:
        ctx.check(
            "TORCH_CUDA_SANITIZER=1", None, "skipped: torch refuses it without CUDA", sanitizer="skipped"
        )
    log = ctx.out / "equivalence-child.log"
    verdict = run_in_child(
        job | {"out": str(out)}, sanitize=ctx.is_cuda, timeout_s=SANITIZER_TIMEOUT_S, log=log
    )
    name = (
        "one run under TORCH_CUDA_SANITIZER=1" if ctx.is_cuda else "one run in a child process (no sanitizer)"
    )
    if not (verdict.get("ok") is True and verdict.get("sanitizer") == ctx.is_cuda):
        error = (verdict.get("error") or "no verdict").strip().splitlines()[-1]
        ctx.check(
            name,
            False,
            f"child exit {verdict.get('exit_code')}, sanitizer on: {verdict.get('sanitizer')}: {error} "
            f"(its output: {log.name})",
            sanitizer=verdict.get("sanitizer"),
        )
        return
    what = f"{size.steps} updates, half the chunks offloaded, blocks {'/'.join(MODES)}, clip {CLIP}"
    found = "the sanitizer reported no unsynchronized access" if ctx.is_cuda else "it finished"
    ctx.check(name, True, f"{what}: {found}", sanitizer=verdict["sanitizer"], seconds=verdict.get("seconds"))
    state = torch.load(out / "state.pt", weights_only=True)
    result = Run(state=state, losses=verdict["losses"], plan=verdict["plan"])
    _judge_fp32(ctx, "fp32, the sanitized run's result", result, reference)


SECTION = Section(
    name="equivalence",
    title="fp32 and bf16 training equal plain PyTorch on the device, under every plan and block mode",
    run=run,
    cpu_counterpart=(
        "tests/unit/test_chunk_engine.py::test_offloaded_chunks_train_exactly_like_plain_pytorch, "
        "tests/unit/test_chunk_engine.py::test_clipped_windows_never_update_early_and_match, "
        "tests/unit/test_chunk_engine.py::test_two_phase_clipped_step_is_bit_exact_and_keeps_no_snapshot, "
        "tests/unit/test_activations.py::test_modes_with_offloaded_chunks_match_plain_pytorch, "
        "tests/unit/test_mixed_precision.py::test_bf16_compute_tracks_the_fp32_reference, "
        "tests/unit/test_residency.py::test_parameters_live_in_the_pool_and_the_device_tier_stays_in_budget, "
        "tests/unit/test_host_model_chunked.py::"
        "test_a_model_twice_the_device_budget_is_chunked_within_the_predicted_peak, "
        "tests/unit/test_stream_chaos_catches.py (the sanitizer's CPU stand-in)"
    ),
)

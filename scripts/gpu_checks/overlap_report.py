"""What the overlap section reports (overlap.py runs it): whether the trace holds every chunk's
jobs, the hidden shares against the 80% target, each chunk's figures beside its profiled compute,
and the runtime's own exposed waits."""

from __future__ import annotations

from typing import Any

from gpu_checks.common import Context
from gpu_checks.trace_overlap import Overlap, TraceParts

TARGET_HIDDEN = 0.80
TRACE_FILE = "overlap_trace.json.gz"
"""Saved in the report directory (open it in Perfetto or chrome://tracing)."""


def report_labels(ctx: Context, parts: TraceParts, shares: Overlap, num_chunks: int) -> None:
    """Every chunk's uploads, gradient copies, adds and CPU Adam are in the trace (else the
    shares would leave work out). On CUDA an upload or a gradient copy counts once a device copy
    was attributed to its label: this fails too when the trace's launch links do not work."""
    missing = {
        kind: [c for c in range(num_chunks) if kind not in shares.per_chunk.get(c, {})]
        for kind in ("gather", "reduce", "host_add", "adam")
    }
    missing = {kind: chunks for kind, chunks in missing.items() if chunks}
    detail = f"gather, reduce, host_add and adam found for all {num_chunks} chunks"
    if missing:
        detail = "; ".join(f"{kind} missing for chunks {chunks}" for kind, chunks in missing.items())
        unattributed = parts.unlabelled_copy_s
        detail += f" ({parts.labels} job labels in the trace; unattributed copies {unattributed:.3f} s)"
    ctx.check("trace: every chunk's jobs labelled", not missing, detail, labels=parts.labels)


def _pct(value: float | None) -> float | None:
    return None if value is None else round(100 * value, 1)


def report_shares(ctx: Context, shares: Overlap, source: str, unlabelled_copy_s: float) -> None:
    for kind, part in sorted(shares.per_kind.items()):
        ctx.check(
            f"hidden: {kind}", None, f"{part.busy_s:.3f} s busy, {_pct(part.fraction)}% behind compute",
            busy_s=round(part.busy_s, 4), hidden_pct=_pct(part.fraction),
        )
    for name, part in (("transfers", shares.transfers), ("host work (adds, CPU Adam)", shares.host)):
        ctx.check(
            f"hidden: {name}", None, f"{part.busy_s:.3f} s busy, {_pct(part.fraction)}% behind compute",
            busy_s=round(part.busy_s, 4), hidden_pct=_pct(part.fraction),
        )
    total = shares.all_work
    fraction = total.fraction or 0.0
    ctx.check(
        "hidden: transfers and CPU optimizer >= 80%",
        fraction >= TARGET_HIDDEN if ctx.is_cuda else None,
        f"{_pct(fraction)}% of {total.busy_s:.3f} s of work ran beside compute ({shares.compute_s:.3f} s on "
        f"{source}); unlabelled copies {unlabelled_copy_s:.3f} s"
        + ("" if ctx.is_cuda else "; CPU figures: the target is judged on CUDA"),
        hidden_pct=_pct(fraction),
        work_s=round(total.busy_s, 4),
        compute_s=round(shares.compute_s, 4),
        trace=TRACE_FILE,
    )


def report_chunks(
    ctx: Context, shares: Overlap, model_profile: Any, hardware: Any, chunk_size: int, micro_batch: int
) -> None:
    """Per chunk: each kind of work's busy time and hidden share, and the chunk's profiled
    compute per micro-batch (forward + backward; scaled from the profile's batch if the run's
    initialize took no profile)."""
    from protrain.profiler.cost_model import chunk_costs

    costs = chunk_costs(model_profile, hardware, chunk_size)
    scale = micro_batch / model_profile.batch_shape[0]
    for chunk, kinds in sorted(shares.per_chunk.items()):
        compute = 0.0
        if chunk < costs.num_chunks:
            forward = costs.fwd[chunk + 1] - costs.fwd[chunk]
            backward = costs.bwd_persistent[chunk + 1] - costs.bwd_persistent[chunk]
            compute = (forward + backward) * scale
        figures: dict[str, Any] = {"compute_profiled_ms": round(compute * 1e3, 3)}
        for kind, part in sorted(kinds.items()):
            figures[f"{kind}_ms"] = round(part.busy_s * 1e3, 3)
            figures[f"{kind}_hidden_pct"] = _pct(part.fraction)
        summary = ", ".join(f"{k} {v}" for k, v in figures.items())
        ctx.check(f"chunk {chunk}", None, summary, **figures)


def report_waits(ctx: Context, records: list[dict[str, Any]]) -> None:
    """The runtime's own account: seconds per update the main thread blocked, by kind."""
    if not records:
        ctx.check("runtime exposed waits", None, "no update records")
        return
    kinds = sorted(records[0]["waits"])
    means = {kind: sum(r["waits"][kind] for r in records) / len(records) for kind in kinds}
    step = sum(r["step_time_s"] for r in records) / len(records)
    exposed = sum(means.values())
    ctx.check(
        "runtime exposed waits",
        None,
        f"per update (mean of {len(records)}): {exposed:.3f} s of {step:.3f} s blocked ("
        + ", ".join(f"{k} {v:.3f}" for k, v in means.items())
        + "); on CUDA a device-side wait is not counted here",
        step_s=round(step, 4),
        exposed_pct=round(100 * exposed / step, 1) if step > 0 else None,
        **{kind: round(value, 4) for kind, value in means.items()},
    )

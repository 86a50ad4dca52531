"""scripts/gpu_checks/trace_overlap.py: the overlap section's reading of a profiler trace, on
hand-made traces in the Chrome format torch.profiler exports (the CUDA one cannot be recorded
here; its fields are Kineto's: kernels and copies with a stream and a correlation id, runtime
calls with the correlation and the "External id" of the operator that made them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

# Loaded from its file (it imports only the standard library): the scripts folder stays off the
# suite's import path.
_PATH = Path(__file__).resolve().parents[2] / "scripts" / "gpu_checks" / "trace_overlap.py"
_SPEC = importlib.util.spec_from_file_location("gpu_check_trace_overlap", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
trace_overlap = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = trace_overlap  # dataclasses look their module up there
_SPEC.loader.exec_module(trace_overlap)
intersect, overlap, parse_trace = trace_overlap.intersect, trace_overlap.overlap, trace_overlap.parse_trace
share, union = trace_overlap.share, trace_overlap.union

MAIN, SIDE, HOST, CUPTI = 1, 2, 3, 999
"""Thread ids: the main thread, the side stream's, the host worker's, and one CUPTI gives a
runtime call that the profiler's threads never carry."""


def x(cat: str, name: str, ts: float, dur: float, tid: Any, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_interval_algebra() -> None:
    assert union([(5, 8), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 8)]
    assert intersect([(0, 4), (5, 8)], [(3, 6), (7, 20)]) == [(3, 4), (5, 6), (7, 8)]
    part = share([(0, 10), (5, 15)], [(10, 30)])
    assert part.busy_s == pytest.approx(15e-6) and part.hidden_s == pytest.approx(5e-6)
    assert part.fraction == pytest.approx(1 / 3)
    assert share([], [(0, 1)]).fraction is None


def cuda_trace() -> dict[str, Any]:
    events = [
        # Compute: two kernels on stream 7; a shorter one on the side stream is not compute.
        x("kernel", "gemm", 0, 100, 7, stream=7, correlation=1),
        x("kernel", "gemm", 150, 100, 7, stream=7, correlation=2),
        x("kernel", "cast", 0, 30, 20, stream=20, correlation=3),
        # Chunk 0's upload: launched by aten::copy_ inside its gather label on the side thread; the
        # runtime call carries CUPTI's thread id, so only the External id finds the label.
        x("user_annotation", "protrain.gather.0", 0, 10, SIDE),
        x("cpu_op", "aten::copy_", 5, 3, SIDE, **{"External id": 11}),
        x("cuda_runtime", "cudaMemcpyAsync", 6, 1, CUPTI, correlation=21, **{"External id": 11}),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 120, 20, stream=20, correlation=21),
        # Chunk 1's gradient copy: no External id, so the runtime call's own thread and time.
        x("user_annotation", "protrain.reduce.1", 200, 10, SIDE),
        x("cuda_runtime", "cudaMemcpyAsync", 205, 1, SIDE, correlation=22),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 240, 60, 20, stream=20, correlation=22),
        # Chunk 2's upload: the runtime call's External id names the label itself (no operator).
        x("user_annotation", "protrain.gather.2", 400, 10, SIDE, **{"External id": 31}),
        x("cuda_runtime", "cudaMemcpyAsync", 405, 1, CUPTI, correlation=24, **{"External id": 31}),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 420, 10, 20, stream=20, correlation=24),
        # The loss read back from the main thread: no label claims it.
        x("cuda_runtime", "cudaMemcpyAsync", 300, 1, MAIN, correlation=23),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 310, 4, 7, stream=7, correlation=23),
        # Host work: chunk 1's Adam on the host worker; a persistent chunk's on the main thread is not.
        x("user_annotation", "protrain.adam.1", 90, 70, HOST),
        x("user_annotation", "protrain.adam.2", 0, 400, MAIN),
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": SIDE, "args": {"name": "side"}},
    ]
    return {"traceEvents": events}


def test_cuda_trace_attributes_copies_to_chunks_and_measures_what_compute_hides() -> None:
    parts = parse_trace(cuda_trace(), cuda=True, main_tid=MAIN)
    assert parts.compute == [(0, 100), (150, 250)]
    assert parts.compute_source == "CUDA stream 7"
    assert parts.work == {
        ("gather", 0): [(50, 170)],
        ("reduce", 1): [(240, 300)],
        ("gather", 2): [(420, 430)],
        ("adam", 1): [(90, 160)],
    }
    assert parts.unlabelled_copy_s == pytest.approx(4e-6)
    result = overlap(parts)
    assert result.compute_s == pytest.approx(200e-6)
    gather = result.per_chunk[0]["gather"]
    assert (gather.busy_s, gather.hidden_s) == pytest.approx((120e-6, 70e-6))  # [50,100] and [150,170]
    assert result.per_chunk[1]["reduce"].hidden_s == pytest.approx(10e-6)  # [240, 250]
    assert result.host.busy_s == pytest.approx(70e-6) and result.host.hidden_s == pytest.approx(20e-6)
    assert result.per_chunk[2]["gather"].fraction == 0.0  # after the last kernel
    assert (result.transfers.busy_s, result.transfers.hidden_s) == pytest.approx((190e-6, 80e-6))
    # Adam ran inside the upload's time: the union counts that time once.
    assert (result.all_work.busy_s, result.all_work.hidden_s) == pytest.approx((190e-6, 80e-6))
    assert set(result.per_kind) == {"gather", "reduce", "adam"}


def test_cpu_trace_takes_the_main_threads_operators_as_compute_and_the_labels_as_work() -> None:
    events = [
        x("cpu_op", "aten::mm", 0, 100, MAIN),
        x("cpu_op", "aten::addmm", 10, 20, MAIN),  # nested: counted once
        x("cpu_op", "aten::copy_", 0, 500, SIDE),  # the side thread's operators are not compute
        x("user_annotation", "protrain.gather.3", 80, 40, SIDE),
        x("user_annotation", "protrain.host_add.3", 120, 10, HOST),
        x("user_annotation", "ProfilerStep#1", 0, 500, MAIN),
    ]
    parts = parse_trace({"traceEvents": events}, cuda=False, main_tid=MAIN)
    assert parts.compute == [(0, 100)]
    result = overlap(parts)
    assert result.per_chunk[3]["gather"].fraction == pytest.approx(0.5)
    assert result.per_chunk[3]["host_add"].fraction == 0.0
    assert result.all_work.busy_s == pytest.approx(50e-6)


def test_a_cuda_trace_without_kernels_is_refused() -> None:
    with pytest.raises(ValueError, match="no CUDA kernels"):
        parse_trace({"traceEvents": [x("cpu_op", "aten::mm", 0, 1, MAIN)]}, cuda=True, main_tid=MAIN)

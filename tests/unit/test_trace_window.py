"""logging.trace (runtime/observability/): a CPU run writes a Chrome trace of exactly the updates asked
for, holding every job label of the pipeline (chunk gathers, reductions, host adds, CPU Adam,
swap out and in, SSD writes and reads, recomputation) on the threads that ran them, whether torch
profiles every thread itself (2.7 and later) or the runtime times the worker threads' labels and
merges them (the path for torch 2.4-2.6, forced here); and the update after the window leaves a
memory timeline whose host and SSD curves account for the bytes the activation manager moved."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from protrain import runtime
from protrain.runtime.chunks.trace_labels import job_label
from protrain.runtime.config.settings import TraceSettings
from protrain_demo.gpt import GPTConfig
from protrain.runtime.observability import profiling
from protrain.runtime.observability.profiling import ThreadTrace
from protrain.runtime.observability.timeline_file import read_timeline, timeline_path, trace_path
from protrain.runtime.observability.trace_window import TraceWindow
from tests.helpers import lm_batches, tiny_gpt

FOUR_BLOCKS = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=2, d_model=64)
MODES = ["ssd", "swap", "checkpoint", "keep"]
TRACED = (2, 3)
"""Updates 2 and 3 traced (start_step 2, steps 2); update 4 records the memory timeline."""
UPDATES = 5
RANGE_KINDS = (
    "gather",
    "reduce",
    "host_add",
    "adam",
    "swap_out",
    "swap_in",
    "ssd_write",
    "ssd_read",
    "recompute",
)


def job(tmp_path: Path) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "precision": "bf16",  # one rank in fp32 on CPU adds gradients in place: no copies to label
        "optimizer": {"lr": 1e-3},
        "memory": {
            "device_budget": "64MiB",
            "chunk_size": "128KiB",
            "n_persist": 0,  # every chunk offloaded: gathers, reductions, host adds, CPU Adam
            "block_modes": MODES,
            "ssd": {"path": str(tmp_path / "ssd")},
        },
        "logging": {"trace": {"start_step": TRACED[0], "steps": len(TRACED)}},
        "output_dir": str(tmp_path / "runs"),
    }


def traced_run(tmp_path: Path) -> dict[str, Any]:
    """Train UPDATES updates under the trace window; what the tests read of the run, with the
    activation manager's own counters per update (bytes swapped out and written, records made)."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    moved: dict[int, tuple[int, int, int]] = {}
    with runtime.initialize(
        tiny_gpt(config=FOUR_BLOCKS), config=job(tmp_path), example_batch=data.batch(0, 0, 0)
    ) as engine:
        stats = engine.activations.stats
        for update in range(UPDATES):
            before = (stats.bytes_swapped_out, stats.bytes_to_ssd, stats.records)
            out = engine(**data.batch(update, 0, 0))
            engine.backward(out.loss)
            engine.step()
            after = (stats.bytes_swapped_out, stats.bytes_to_ssd, stats.records)
            moved[update + 1] = (after[0] - before[0], after[1] - before[1], after[2] - before[2])
        plan, static = engine.plan, engine.chunks.device_state_bytes()
    (run_dir,) = (tmp_path / "runs").iterdir()
    return {"run_dir": run_dir, "plan": plan, "moved": moved, "static": static}


@pytest.fixture(scope="module")
def torch_profiled_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run for the trace and the timeline tests (the path torch 2.7 and later take)."""
    return traced_run(tmp_path_factory.mktemp("traced"))


def user_ranges(trace: dict[str, Any]) -> dict[str, set[int]]:
    """Each protrain label's kind -> the thread ids it ran on."""
    threads: dict[str, set[int]] = defaultdict(set)
    for event in trace["traceEvents"]:
        name = str(event.get("name", ""))
        if event.get("cat") == "user_annotation" and name.startswith("protrain."):
            threads[name.split(".")[1]].add(event["tid"])
    return threads


def check_chrome_json(trace: dict[str, Any]) -> None:
    """What Perfetto's JSON importer needs: complete events with numeric times on a pid/tid."""
    events = trace["traceEvents"]
    assert events, "an empty trace"
    for event in events:
        assert event["ph"] in ("X", "M", "i", "s", "f", "C", "B", "E", "b", "e", "n", "P"), event
        if event["ph"] == "X":
            assert isinstance(event["ts"], (int, float)) and isinstance(event["dur"], (int, float)), event
            assert "pid" in event and "tid" in event, event


def check_trace(run_dir: Path, *, merged_ranges: bool) -> None:
    with gzip.open(trace_path(run_dir, 0), "rt", encoding="utf-8") as file:
        trace = json.load(file)
    check_chrome_json(trace)
    threads = user_ranges(trace)
    for kind in RANGE_KINDS:
        assert threads.get(kind), f"no protrain.{kind}.* range in the trace: {sorted(threads)}"
    main = threading.main_thread().native_id
    all_tids = {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert len(all_tids) > 2, all_tids
    for kind, tids in threads.items():
        if kind == "recompute":
            assert tids == {main}, "on CPU backward (and so the recomputation) runs on the main thread"
        else:
            assert main not in tids, f"{kind} ran on the main thread: the pipeline's jobs belong to workers"
    # The window is exactly the traced updates: one checkpointed block recomputed once in each.
    recomputes = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("protrain.recompute.")]
    assert len(recomputes) == len(TRACED)
    names = {e["args"]["name"].split(" (")[0] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"protrain-host-worker", "protrain-chunks", "protrain-activations", "protrain-ssd_0"} <= names
    merged = [e for e in trace["traceEvents"] if "timed by" in e.get("args", {})]
    assert bool(merged) is merged_ranges


def test_a_trace_window_holds_every_range_on_the_threads_that_ran_it(
    torch_profiled_run: dict[str, Any],
) -> None:
    if not profiling.can_profile_every_thread():
        pytest.skip("this torch cannot profile every thread: the next test covers it")
    check_trace(torch_profiled_run["run_dir"], merged_ranges=False)


def test_before_torch_2_7_the_worker_threads_ranges_are_timed_and_merged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.4-2.6 profile the starting thread only: the runtime times the labels itself."""
    monkeypatch.setattr(profiling, "can_profile_every_thread", lambda: False)
    check_trace(traced_run(tmp_path)["run_dir"], merged_ranges=True)


def test_the_update_after_the_window_leaves_a_memory_timeline(torch_profiled_run: dict[str, Any]) -> None:
    run = torch_profiled_run
    timeline = read_timeline(timeline_path(run["run_dir"], 0))
    assert timeline.update == TRACED[-1] + 1 and timeline.micro_batches == 1
    assert timeline.instrumented_updates == (*TRACED, TRACED[-1] + 1)
    assert [s.phase for s in timeline.spans] == ["between", "forward", "backward", "optimizer"]
    assert Counter(s.phase for s in timeline.samples).keys() >= {"forward", "backward", "recompute"}
    marks = Counter((m.kind, m.index) for m in timeline.marks)
    for block in range(len(MODES)):
        assert marks[("block_forward", block)] == 1 and marks[("block_backward", block)] == 1
    for chunk in range(run["plan"].num_chunks):
        assert marks[("gather", chunk)] >= 1 and marks[("evict", chunk)] >= 1, chunk
    assert timeline.predicted_peak_device_bytes == run["plan"].predicted_peak_device_bytes is not None
    swapped, to_ssd, records = run["moved"][timeline.update]
    # Host: the swap pool fills by what the swap block sent (each allocation page-rounded), then empties.
    host = [s.host_bytes for s in timeline.samples]
    assert 0 < swapped <= max(host) - host[0] <= swapped + 4096 * records
    assert host[-1] == host[0]
    # SSD: the ssd block's files on disk during the step (padded to 4 KiB under O_DIRECT), none after.
    ssd = [s.ssd_bytes for s in timeline.samples]
    assert 0 < max(ssd) <= to_ssd + 4096 * records and ssd[0] == ssd[-1] == 0
    # Device (CPU): the static device state at the start, as the plan check counts it, then activations.
    assert abs(timeline.samples[0].device_bytes - run["static"]) < 64 << 10
    assert max(s.device_bytes for s in timeline.samples) > timeline.samples[0].device_bytes


def test_worker_ranges_timed_here_land_on_the_profilers_time_axis(tmp_path: Path) -> None:
    """The merge for torch before 2.7, alone: a worker's label that ran between two main-thread
    labels 20 ms apart lands between them in the trace (to within the clock mark's microseconds),
    on the worker's thread, named after it."""
    trace = ThreadTrace(cuda=False, every_thread=False)
    trace.start()
    with job_label("gather", 0):
        pass

    def adam() -> None:
        with job_label("adam", 7):
            time.sleep(0.005)

    worker = threading.Thread(target=adam, name="the-worker")
    time.sleep(0.01)
    worker.start()
    worker.join()
    time.sleep(0.01)
    with job_label("gather", 2):
        pass
    trace.stop()
    trace.export(tmp_path / "t.json.gz")
    with gzip.open(tmp_path / "t.json.gz", "rt") as file:
        events = json.load(file)["traceEvents"]
    ranges = {e["name"]: e for e in events if e.get("cat") == "user_annotation"}
    adam_range, before, after = (
        ranges["protrain.adam.7"],
        ranges["protrain.gather.0"],
        ranges["protrain.gather.2"],
    )
    assert adam_range["tid"] == worker.native_id != before["tid"]
    slack_us = 1000
    assert before["ts"] + before["dur"] + 10_000 - slack_us <= adam_range["ts"]
    assert adam_range["ts"] + adam_range["dur"] + 10_000 - slack_us <= after["ts"]
    assert adam_range["dur"] >= 5_000
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert names[worker.native_id] == f"the-worker ({worker.native_id})"


def test_a_run_that_ends_inside_the_window_still_writes_its_trace(tmp_path: Path) -> None:
    said: list[str] = []
    window = TraceWindow(
        TraceSettings(start_step=1, steps=3), run_dir=tmp_path, rank=0, cuda=False, log=said.append
    )
    engine = SimpleNamespace(global_step=0, skipped_steps=0)
    window.window_started(engine)  # type: ignore[arg-type]
    with job_label("adam", 0):
        pass
    window.close()
    window.close()  # idempotent, says nothing more
    assert trace_path(tmp_path, 0).is_file()
    assert said[0].startswith("trace of updates 1-3 (the run ended inside the window)")
    assert said[1].startswith("no memory timeline: the run ended before update 4")
    assert len(said) == 2

"""The pipeline labels its jobs for a profiler (runtime/chunks/trace_labels.py): with every chunk
offloaded, a trace of one update holds each chunk's upload, gradient copy, gradient add and CPU
Adam under ``protrain.<kind>.<chunk>``, on the worker threads that ran them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from protrain import runtime
from tests.helpers import lm_batches, tiny_gpt


def test_every_offloaded_chunks_jobs_are_labelled_on_worker_threads(tmp_path: Path) -> None:
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "precision": "bf16",  # one rank in fp32 on CPU adds gradients in place: no copies to label
        "optimizer": {"lr": 1e-3},
        "memory": {"chunk_size": "128KiB", "n_persist": 0, "n_buffer": 2, "n_swap": 0, "n_checkpoint": 0},
        "output_dir": str(tmp_path / "runs"),
    }
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        num_chunks = engine.plan.num_chunks
        every_thread = _ExperimentalConfig(profile_all_threads=True)
        with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    labels = {(e["name"], e["tid"]) for e in events if e.get("cat") == "user_annotation"}
    names = {name for name, _ in labels}
    assert num_chunks > 1
    for chunk in range(num_chunks):
        for kind in ("gather", "reduce", "host_add", "adam"):
            assert f"protrain.{kind}.{chunk}" in names, (kind, chunk, sorted(names))
    main = threading.main_thread().native_id
    assert all(tid != main for name, tid in labels if name.startswith("protrain."))

"""Re-planning when the measured peak exceeds the prediction: the engine searches again with its
budget shrunk by the overshoot, moves every parameter, moment and step count into the new plan's
chunk layout in memory, says so, and trains on with the math unchanged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from protrain import runtime
from protrain.runtime.chunks.layout import layout_from_params
from tests.checkpointing import checkpoint_tensors
from tests.helpers import assert_state_equal, lm_batches, tiny_gpt, train_reference, train_updates
from tests.unit.test_planning import all_kept_plan, big_batch_job, job

STEPS = 9


def underestimated(engine: Any, factor: float) -> None:
    """Make the plan's peak prediction ``factor`` times what the profile said, as a profile that
    missed part of the run's memory would: the measured peak then exceeds it."""
    low = int(engine.plan.predicted_peak_device_bytes * factor)
    engine._plans._adopt(dataclasses.replace(engine.plan, predicted_peak_device_bytes=low), rebuilt=False)


def test_a_peak_above_the_prediction_re_plans_and_training_stays_exact(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=16, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    kept_peak = all_kept_plan(tmp_path, data.batch(0, 0, 0)).predicted_peak_device_bytes
    assert kept_peak is not None
    # A budget the all-kept plan fits with a third to spare, and a prediction half the truth.
    config = big_batch_job(tmp_path, int(kept_peak * 1.3))
    engine = runtime.initialize(tiny_gpt(), config=config, example_batch=data.batch(0, 0, 0))
    first = engine.plan
    underestimated(engine, 0.5)
    train_updates(engine, data, range(STEPS))
    assert engine.replans == 1
    second = engine.plan
    assert second.rule.startswith("re-planned (measured peak") and second != first
    assert second.predicted_peak_device_bytes is not None and first.predicted_peak_device_bytes is not None
    assert second.predicted_peak_device_bytes < kept_peak  # a leaner plan: recompute or offload
    assert_state_equal(engine.state_dict(), expected)
    engine.close()
    metrics = sorted((tmp_path / "runs").glob("*/metrics.jsonl"))[-1]  # the second engine's run
    plans = [
        json.loads(line)["plan"] for line in metrics.read_text().splitlines() if '"event": "plan"' in line
    ]
    assert plans[-1]["rule"].startswith("re-planned") and not plans[-2]["rule"].startswith("re-planned")


def test_moving_state_between_layouts_keeps_every_value(tmp_path: Path) -> None:
    """64 KiB chunks with one persistent, to 256 KiB chunks all offloaded: every parameter, Adam
    moment and step count is the same afterwards, read through torch's own checkpoint converter."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, n_persist=1, n_buffer=2))
    for update in range(2):
        out = engine(**data.batch(update, 0, 0))
        engine.backward(out.loss)
        engine.step()
    before = checkpoint_tensors(str(engine.save_checkpoint(tmp_path / "before")))
    old = engine.chunks
    layout = layout_from_params(tuple(old.layout.params), chunk_numel=256 * 1024 // 4, world_size=1)
    engine.switch_plan(
        dataclasses.replace(
            engine.plan, chunk_size=256 * 1024, num_chunks=layout.num_chunks, n_persist=0, n_buffer=2
        )
    )
    assert engine.chunks is not old and engine.chunks.layout.num_chunks == layout.num_chunks
    after = checkpoint_tensors(str(engine.save_checkpoint(tmp_path / "after")))
    assert set(after) == set(before)
    assert_state_equal(after, before)
    # And it trains on: one more update under the new layout.
    out = engine(**data.batch(2, 0, 0))
    engine.backward(out.loss)
    assert engine.step()
    engine.close()


def test_without_an_example_batch_the_first_batch_is_profiled_and_searched(tmp_path: Path) -> None:
    """No example batch: the engine starts under the resident rule, profiles on the first real
    batch (no training happens in it), searches, and switches; the run equals plain PyTorch."""
    data = lm_batches(micro_batch_size=16, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    kept_peak = all_kept_plan(tmp_path, data.batch(0, 0, 0)).predicted_peak_device_bytes
    assert kept_peak is not None
    # Tight enough that the search must recompute or offload; the resident rule ignores it.
    config = big_batch_job(tmp_path, int(kept_peak * 0.65))
    engine = runtime.initialize(tiny_gpt(), config=config)
    assert engine.plan.predicted_step_s is None and not engine.plan.rule.startswith("search")
    train_updates(engine, data, range(1))  # profiled, planned and switched here
    plan = engine.plan
    assert plan.rule.startswith("planned on a batch through the chunk engine: search")
    assert plan.predicted_peak_device_bytes is not None
    assert plan.predicted_peak_device_bytes * 1.05 <= int(kept_peak * 0.65)
    train_updates(engine, data, range(1, STEPS))
    assert_state_equal(engine.state_dict(), expected)
    engine.close()

"""The plan check after the first updates: which way the prediction is off, and a cached profile
whose compute (the forward and backward phases) is off by more than 25% named stale: noted in the
cache by the first launch that finds it so, dropped by the second, measured again by the third;
a busy host that slows the rest of the step, or one busy launch between right ones, costs no
profiling. Step and phase times come from fake clocks given to ``initialize`` (the engine's and
the phase clock's), so the verdicts do not depend on how busy the machine is; the profiles are
real."""

from __future__ import annotations

import dataclasses
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.runtime.planning.model_profiling import profile_model
from protrain.runtime.planning.plan_check import CHECK_AFTER_UPDATES
from protrain.runtime.planning.profilers import Profilers
from protrain.runtime.planning.profile_cache import FOUND_OFF
from protrain.runtime.training.engine import Engine
from tests.helpers import lm_batches, tiny_gpt, train_updates


def job(tmp_path: Path, run: str) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3},
        "memory": {"chunk_size": "64KiB", "device_budget": "64MiB"},
        "profiler": {"cache_dir": str(tmp_path / "cache"), "warmup_steps": 1, "profile_steps": 1},
        "output_dir": str(tmp_path / run),
    }


def example() -> dict[str, torch.Tensor]:
    return lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)


class FakeClocks:
    """The engine's step clock and its phase clock, moving ``step_s`` and ``phase_s`` at each
    reading (0 until ``train_at`` sets them)."""

    def __init__(self) -> None:
        self.step_s = self.phase_s = 0.0
        self._step = self._phase = 0.0

    def step(self) -> float:
        self._step += self.step_s
        return self._step

    def phase(self) -> float:
        self._phase += self.phase_s
        return self._phase


CLOCKS: weakref.WeakKeyDictionary[Engine, FakeClocks] = weakref.WeakKeyDictionary()


def start(tmp_path: Path, run: str, profilers: Profilers | None = None) -> Engine:
    clocks = FakeClocks()
    profilers = dataclasses.replace(profilers or Profilers(), clock=clocks.step, compute_clock=clocks.phase)
    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, run), example_batch=example(), profilers=profilers)
    CLOCKS[engine] = clocks
    return engine


def train_at(engine: Engine, step_s: float, compute_s: float | None = None) -> None:
    """Train until the plan check, every update taking ``step_s`` on the engine's clock (read at
    each update's first forward and after its step) and ``compute_s`` in its forward and backward
    phases (the phase clock is read at their starts and ends and at the update's end; None: the
    plan's predicted compute, as a right profile would measure)."""
    predicted = engine.plan.predicted_compute_s
    assert predicted is not None
    clocks = CLOCKS[engine]
    clocks.step_s, clocks.phase_s = step_s, (predicted if compute_s is None else compute_s) / 2
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    train_updates(engine, data, range(CHECK_AFTER_UPDATES))
    engine.close()


def plan_check_record(tmp_path: Path, run: str) -> dict[str, Any]:
    (metrics,) = (tmp_path / run).glob("*/metrics.jsonl")
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    return next(event for event in events if event.get("event") == "plan_check")


def printed(capsys: pytest.CaptureFixture[str]) -> str:
    return " ".join(capsys.readouterr().out.split())  # the console wraps long lines


def cache_entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache").glob("*.json"))


def scale_times(entry: Path, factor: float) -> None:
    """Multiply every time in a cached model profile by ``factor`` (a busier moment)."""
    body = json.loads(entry.read_text())
    body["other_forward_s"] *= factor
    body["other_backward_s"] *= factor
    for block in body["blocks"]:
        block["forward_s"] *= factor
        block["backward_s"] *= factor
    entry.write_text(json.dumps(body))


def from_the_cache(tmp_path: Path, run: str) -> tuple[list[Path], Engine]:
    """A launch that profiles and fills the cache, then ``run``'s engine planned from it."""
    start(tmp_path, "fresh").close()
    return cache_entries(tmp_path), start(tmp_path, run)


def stale_cache(tmp_path: Path) -> tuple[float, float]:
    """A cached model profile whose times are twice what this machine measures now; the step and
    compute times a right profile predicts."""
    fresh = start(tmp_path, "fresh")
    step_s, compute_s = fresh.plan.predicted_step_s, fresh.plan.predicted_compute_s
    assert step_s is not None and compute_s is not None
    fresh.close()
    (model_entry,) = (tmp_path / "cache").glob("model-*.json")
    scale_times(model_entry, 2.0)  # profiled at a moment twice as busy as now
    return step_s, compute_s


def test_a_stale_cached_profile_is_noted_then_dropped_by_the_next_launch_then_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step_s, compute_s = stale_cache(tmp_path)
    for launch in ("first", "second"):
        stale = start(tmp_path, launch)
        predicted = stale.plan.predicted_compute_s
        assert predicted is not None and predicted > 1.25 * compute_s, "doubled, it is off by more than 25%"
        capsys.readouterr()
        train_at(stale, step_s, compute_s)
        out = printed(capsys)
        check = plan_check_record(tmp_path, launch)
        assert check["profile"] == "cached" and check["off"] is True
        assert f"predicted {check['predicted_compute_s']:.4f} s ({check['compute_error']:+.1%})" in out
        assert "the forward and backward time is off" in out and "the cached profile looks stale" in out
        if launch == "first":  # one launch is not enough: noted in both entries, which stay
            assert "noted in the cache: if the next launch finds it off too" in out
            assert "dropped_profiles" not in check and len(check["noted_off"]) == 2
            assert all(FOUND_OFF in json.loads(entry.read_text()) for entry in cache_entries(tmp_path))
    assert "the previous launch found it off too: dropped it from the cache" in out
    assert {Path(path).name.split("-")[0] for path in check["dropped_profiles"]} == {"model", "hardware"}
    assert cache_entries(tmp_path) == [], "the stale entries are gone from the cache"

    profiled: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        profiled.append(1)
        return profile_model(*args, **kwargs)

    again = start(tmp_path, "again", Profilers(model=counted))
    again.close()
    assert profiled, "the third launch measured the model again"
    assert len(cache_entries(tmp_path)) == 2  # measured and cached again


def test_one_off_launch_between_right_ones_costs_no_profiling(tmp_path: Path) -> None:
    entries, busy = from_the_cache(tmp_path, "busy")
    assert busy.plan.predicted_compute_s is not None and busy.plan.predicted_step_s is not None
    train_at(busy, busy.plan.predicted_step_s, busy.plan.predicted_compute_s * 2)
    assert plan_check_record(tmp_path, "busy")["off"] is True
    assert all(FOUND_OFF in json.loads(entry.read_text()) for entry in entries)
    right = start(tmp_path, "right")
    assert right.plan.predicted_step_s is not None
    train_at(right, right.plan.predicted_step_s)
    assert plan_check_record(tmp_path, "right")["off"] is False
    assert cache_entries(tmp_path) == entries
    assert not any(FOUND_OFF in json.loads(entry.read_text()) for entry in entries), "the note is cleared"


def test_a_busy_host_that_slows_the_step_but_not_the_compute_keeps_the_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the step time was compared: every launch on a busy machine dropped the cache."""
    entries, busy = from_the_cache(tmp_path, "busy")
    predicted_s = busy.plan.predicted_step_s
    assert predicted_s is not None
    capsys.readouterr()
    train_at(busy, predicted_s * 2)  # CPU Adam and the update twice as slow
    check = plan_check_record(tmp_path, "busy")
    assert check["error"] == pytest.approx(-0.5, abs=1e-3) and check["compute_error"] == pytest.approx(0, abs=1e-3)
    assert check["off"] is False and "noted_off" not in check and "dropped_profiles" not in check
    assert "stale" not in printed(capsys)
    assert cache_entries(tmp_path) == entries
    assert not any(FOUND_OFF in json.loads(entry.read_text()) for entry in entries)


def test_a_cached_profile_within_25_percent_is_kept_and_nothing_more_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entries, cached = from_the_cache(tmp_path, "cached")
    predicted_s, compute_s = cached.plan.predicted_step_s, cached.plan.predicted_compute_s
    assert predicted_s is not None and compute_s is not None
    capsys.readouterr()
    train_at(cached, predicted_s * 1.2, compute_s * 1.2)  # predictions 16.7% below
    out = printed(capsys)
    check = plan_check_record(tmp_path, "cached")
    assert check["profile"] == "cached" and check["off"] is False and "dropped_profiles" not in check
    assert f"prediction {-check['error']:.1%} below the measured" in out
    assert "plan check: the" not in out and "stale" not in out
    assert cache_entries(tmp_path) == entries


def test_a_profile_measured_in_this_run_and_off_blames_the_cost_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = start(tmp_path, "fresh")
    predicted_s = fresh.plan.predicted_step_s
    assert predicted_s is not None
    capsys.readouterr()
    compute_s = fresh.plan.predicted_compute_s
    assert compute_s is not None
    train_at(fresh, predicted_s / 2, compute_s / 2)
    out = printed(capsys)
    check = plan_check_record(tmp_path, "fresh")
    assert check["profile"] == "measured" and check["off"] is True
    assert "prediction 100.0% above the measured" in out
    assert "although the profile was measured in this run: the cost model misjudges this run" in out
    assert "stale" not in out and len(cache_entries(tmp_path)) == 2  # nothing to drop

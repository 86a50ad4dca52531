"""The plan check after the first updates: which way the prediction is off, and a cached profile
whose prediction is off by more than 25% named stale, dropped from the cache and measured again
at the next launch. Step times come from a fake clock (the engine's), so the verdicts do not
depend on how busy the machine is; the profiles are real."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
import protrain.runtime.training.engine
from protrain.runtime.planning.model_profiling import profile_model
from protrain.runtime.planning.plan_check import CHECK_AFTER_UPDATES
from protrain.runtime.planning.planner import Profilers
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


def start(tmp_path: Path, run: str, profilers: Profilers | None = None) -> Engine:
    config = job(tmp_path, run)
    return runtime.initialize(tiny_gpt(), config=config, example_batch=example(), profilers=profilers)


def train_at(engine: Engine, step_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Train until the plan check, every update taking ``step_s`` on the engine's clock."""
    now = [0.0]

    def clock() -> float:  # read at each update's first forward and after its step
        now[0] += step_s
        return now[0]

    with monkeypatch.context() as patch:
        patch.setattr(protrain.runtime.training.engine, "time", types.SimpleNamespace(perf_counter=clock))
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


def test_a_stale_cached_profile_is_named_dropped_and_measured_at_the_next_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = start(tmp_path, "fresh")
    measured_s = fresh.plan.predicted_step_s
    assert measured_s is not None
    fresh.close()
    (model_entry,) = (tmp_path / "cache").glob("model-*.json")
    scale_times(model_entry, 2.0)  # profiled at a moment twice as busy as now

    stale = start(tmp_path, "stale")
    assert stale.plan.predicted_step_s is not None and stale.plan.predicted_step_s > 1.25 * measured_s, (
        "compute dominates the tiny model's predicted step: doubled, it is off by more than 25%"
    )
    capsys.readouterr()
    train_at(stale, measured_s, monkeypatch)
    out = printed(capsys)
    check = plan_check_record(tmp_path, "stale")
    assert f"prediction {check['error']:.1%} above the measured" in out
    assert "the cached profile looks stale" in out and "the next launch profiles again" in out
    assert check["profile"] == "cached" and check["off"] is True
    assert {Path(path).name.split("-")[0] for path in check["dropped_profiles"]} == {"model", "hardware"}
    assert cache_entries(tmp_path) == [], "the stale entries are gone from the cache"

    profiled: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        profiled.append(1)
        return profile_model(*args, **kwargs)

    again = start(tmp_path, "again", Profilers(model=counted))
    again.close()
    assert profiled, "the next launch measured the model again"
    assert len(cache_entries(tmp_path)) == 2  # measured and cached again


def test_a_cached_profile_within_25_percent_is_kept_and_nothing_more_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    start(tmp_path, "fresh").close()
    entries = cache_entries(tmp_path)
    cached = start(tmp_path, "cached")
    predicted_s = cached.plan.predicted_step_s
    assert predicted_s is not None
    capsys.readouterr()
    train_at(cached, predicted_s * 1.2, monkeypatch)  # the prediction 16.7% below the measured
    out = printed(capsys)
    check = plan_check_record(tmp_path, "cached")
    assert check["profile"] == "cached" and check["off"] is False and "dropped_profiles" not in check
    assert f"prediction {-check['error']:.1%} below the measured" in out
    assert "plan check: the step time" not in out and "stale" not in out
    assert cache_entries(tmp_path) == entries


def test_a_profile_measured_in_this_run_and_off_blames_the_cost_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = start(tmp_path, "fresh")
    predicted_s = fresh.plan.predicted_step_s
    assert predicted_s is not None
    capsys.readouterr()
    train_at(fresh, predicted_s / 2, monkeypatch)
    out = printed(capsys)
    check = plan_check_record(tmp_path, "fresh")
    assert check["profile"] == "measured" and check["off"] is True
    assert "prediction 100.0% above the measured" in out
    assert "although the profile was measured in this run: the cost model misjudges this run" in out
    assert "stale" not in out and len(cache_entries(tmp_path)) == 2  # nothing to drop

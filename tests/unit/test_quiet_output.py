"""What a run prints before its first step: one plan table per engine, and a parameter group of
many exact names (the Trainer's no-decay group) as a count, not every name."""

from __future__ import annotations

from pathlib import Path

import pytest

from protrain import runtime
from tests.helpers import lm_batches, tiny_gpt


def table_titles(out: str) -> int:
    return sum(1 for line in out.splitlines() if line.strip() == "ProTrain plan")


def test_an_engine_planned_on_its_first_batch_prints_one_plan_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without an example batch the plan is settled on the first batch: one line says so at
    initialize and the table comes then (before: the rule's table, then the searched one)."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    config = {"seed": 1, "micro_batch_size": 2, "optimizer": {"lr": 1e-3}, "output_dir": str(tmp_path)}
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        at_start = capsys.readouterr().out
        assert table_titles(at_start) == 0 and "ProTrain plan: settled on the first batch" in at_start
        for update in range(2):
            out = engine(**data.batch(update, 0, 0))
            engine.backward(out.loss)
            engine.step()
        assert engine.plan.rule.startswith("planned on a batch")
    assert table_titles(capsys.readouterr().out) == 1


def test_a_group_of_many_exact_names_shows_their_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_gpt()
    names = [name for name, p in model.named_parameters() if p.dim() == 1]
    assert len(names) > 4
    config = {
        "seed": 1,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "groups": [{"match": names, "weight_decay": 0.0}]},
        "memory": {"chunk_size": "64KiB", "n_persist": "auto"},
        "output_dir": str(tmp_path),
    }
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)
    with runtime.initialize(model, config=config, example_batch=batch):
        pass
    out = capsys.readouterr().out
    assert f"{len(names)} names:" in out  # the cell folds the two names shown across its lines
    assert names[-1] not in out, "every name listed"


@pytest.mark.parametrize("level", ["quiet", "info", "debug"])
def test_logging_level_says_how_much_rank_0_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], level: str
) -> None:
    """quiet: nothing (metrics.jsonl is written all the same); info: the plan and a progress line
    every few updates; debug: a line every update, with the waits behind it."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    config = {
        "seed": 1,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3},
        "scheduler": {"type": "constant", "total_steps": 100},
        "logging": {"level": level},
        "output_dir": str(tmp_path),
    }
    with runtime.initialize(tiny_gpt(), config=config) as engine:
        for update in range(3):
            out = engine(**data.batch(update, 0, 0))
            engine.backward(out.loss)
            engine.step()
    printed = capsys.readouterr().out
    steps = [line for line in printed.splitlines() if line.startswith("step ")]
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    assert len([line for line in metrics.read_text().splitlines() if '"step"' in line]) == 3
    if level == "quiet":
        assert printed == ""
    elif level == "info":
        assert table_titles(printed) == 1 and [s.split()[1] for s in steps] == ["1/100"]  # then every 5th
    else:
        assert [s.split()[1] for s in steps] == ["1/100", "2/100", "3/100"]
        assert all("waits (ms): transfer_s" in s for s in steps)

"""``memory.n_replicate`` on one process: only persistent chunks are replicated, and a plan that
replicates more than it keeps on the device is refused before anything is built, naming both
keys. (Replication itself is tested on two ranks: tests/distributed/test_replicated_two_ranks.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from protrain import runtime
from protrain.runtime.config.spec_io import SpecError
from tests.helpers import tiny_gpt
from tests.unit.test_planning import example, job


def test_replicating_more_chunks_than_persist_is_refused(tmp_path: Path) -> None:
    config = job(tmp_path, n_persist=2, n_replicate=3, n_buffer=2)
    with pytest.raises(SpecError, match=r"memory\.n_replicate=3 exceeds the 2 persistent chunks \(memory\.n_persist\)"):
        runtime.initialize(tiny_gpt(), config=config)
    with pytest.raises(SpecError, match=r"memory\.n_replicate=3 exceeds"):
        runtime.initialize(tiny_gpt(), config=config, example_batch=example())


def test_the_plan_table_says_how_many_chunks_are_replicated(tmp_path: Path) -> None:
    config = job(tmp_path, n_persist=4, n_replicate=2, n_buffer=2)
    with runtime.initialize(tiny_gpt(), config=config, example_batch=example()) as engine:
        plan = engine.plan
        rows = {knob: (value, origin) for knob, value, origin in plan.rows()}
        replicated = sum(1 for chunk in engine.chunks.chunks if chunk.is_replicated)
    assert (plan.n_replicate, replicated) == (2, 2)
    assert rows["n_replicate"] == ("2", "spec")

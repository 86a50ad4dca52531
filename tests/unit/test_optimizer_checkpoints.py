"""Checkpoints of lion and sgd runs: a stopped and resumed run ends bit-identical to the run that
went on (Lion's moment, SGD's momentum buffer and its step counts, which tell a first update,
come back), and a checkpoint is refused by a job whose optimizer could not continue its state:
another rule, or SGD with momentum where none was kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from protrain import runtime
from protrain.runtime.checkpoint.store import CheckpointError
from tests.checkpointing import DROPOUT_GPT, checkpoint_job, train_until
from tests.helpers import assert_state_equal, tiny_gpt

RULES = {
    "lion": {"type": "lion", "lr": 3e-4},
    "sgd-momentum-dampening": {"type": "sgd", "lr": 0.05, "momentum": 0.9, "dampening": 0.1},
}


@pytest.mark.parametrize("case", list(RULES))
def test_a_resumed_run_ends_bit_identical_to_the_uninterrupted_one(tmp_path: Path, case: str) -> None:
    optimizer = RULES[case]
    whole = train_until(checkpoint_job(str(tmp_path / "whole"), optimizer=optimizer), until=6)
    first = train_until(
        checkpoint_job(str(tmp_path / "cut"), optimizer=optimizer, checkpoint={"interval_steps": 3}), until=4
    )
    assert first["offloaded_chunks"] > 0, "the host path's state is checkpointed too"
    second = train_until(checkpoint_job(str(tmp_path / "cut"), optimizer=optimizer), until=6)
    assert second["started_at"] == 3
    assert first["losses"][:3] + second["losses"] == whole["losses"]
    assert_state_equal(second["state"], whole["state"])


def resume_error(tmp_path: Path, saved: dict[str, Any], resumed: dict[str, Any]) -> str:
    train_until(checkpoint_job(str(tmp_path), optimizer=saved, checkpoint={"interval_steps": 1}), until=1)
    config = checkpoint_job(
        str(tmp_path / "other"), optimizer=resumed, checkpoint={"resume": str(tmp_path / "ckpt" / "step-00000001")}
    )
    with pytest.raises(CheckpointError) as caught:
        runtime.initialize(tiny_gpt(0, DROPOUT_GPT), config=config)
    return str(caught.value)


def test_a_checkpoint_of_another_optimizer_is_refused_naming_both(tmp_path: Path) -> None:
    message = resume_error(tmp_path, {"type": "adamw"}, {"type": "lion"})
    assert "saved by optimizer.type 'adamw', this job runs 'lion'" in message
    assert "Resume with optimizer.type: adamw" in message


def test_sgd_with_momentum_is_refused_a_checkpoint_that_kept_no_buffer(tmp_path: Path) -> None:
    message = resume_error(tmp_path, {"type": "sgd", "lr": 0.05}, {"type": "sgd", "lr": 0.05, "momentum": 0.9})
    assert "holds the optimizer state none, this job's sgd needs momentum_buffer" in message

"""``TrainingArguments.optim`` under a ``ProTrainTrainer``: the Trainer's SGD (with the momentum
``optim_args`` gives) trains as a plain Trainer's ``torch.optim.SGD``; lion_32bit is the engine's
Lion with the Trainer's Adam betas; names no rule runs are refused naming why; the spec and the
Trainer must agree on the optimizer as on every other setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from protrain.runtime.integrations.hf_spec import reconcile, user_spec
from tests.hf_trainer_runs import run_trainer, training_args

RTOL = 1e-5
SGD_ARGS = {"optim": "sgd", "optim_args": "momentum=0.9,nesterov=True", "learning_rate": 0.05, "max_steps": 8}


def test_the_trainers_sgd_with_momentum_trains_as_the_plain_trainers(tmp_path: Path) -> None:
    plain = run_trainer(kind="llama", protrain=False, output_dir=str(tmp_path / "plain"), **SGD_ARGS)
    ours = run_trainer(kind="llama", protrain=True, output_dir=str(tmp_path / "ours"), **SGD_ARGS)
    assert len(ours["losses"]) == len(plain["losses"]) == 8
    assert ours["losses"] == pytest.approx(plain["losses"], rel=RTOL)
    assert ours["grad_norms"] == pytest.approx(plain["grad_norms"], rel=RTOL)
    assert ours["eval_loss"] == pytest.approx(plain["eval_loss"], rel=RTOL)
    assert plain["losses"][-1] < plain["losses"][0] - 0.05, "the updates are not rounding-sized"


def test_the_trainers_optimizer_names_map_to_the_engines_rules(tmp_path: Path) -> None:
    sgd = reconcile(user_spec({}), training_args(tmp_path, **SGD_ARGS)).spec.optimizer
    assert (sgd.type, sgd.momentum, sgd.dampening, sgd.nesterov) == ("sgd", 0.9, 0.0, True)
    lion = reconcile(user_spec({}), training_args(tmp_path, optim="lion_32bit", adam_beta2=0.99)).spec.optimizer
    assert (lion.type, lion.betas) == ("lion", (0.9, 0.99))
    assert reconcile(user_spec({}), training_args(tmp_path)).spec.optimizer.type == "adamw"
    # Set in the spec only: the Trainer is told (adam has no Trainer name: nothing to tell).
    settled = reconcile(user_spec({"optimizer": {"type": "lion"}}), training_args(tmp_path))
    assert settled.spec.optimizer.type == "lion" and settled.args_updates["optim"] == "lion_32bit"
    settled = reconcile(user_spec({"optimizer": {"type": "adam"}}), training_args(tmp_path))
    assert settled.spec.optimizer.type == "adam" and "optim" not in settled.args_updates


def test_an_optimizer_set_differently_in_both_places_is_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"optimizer.type='lion' in the ProTrain spec and optim=.*sgd"):
        reconcile(user_spec({"optimizer": {"type": "lion"}}), training_args(tmp_path, optim="sgd"))
    spec = user_spec({"optimizer": {"type": "sgd", "momentum": 0.5}})
    with pytest.raises(ValueError, match=r"optimizer.momentum=0.5 in the ProTrain spec and optim_args="):
        reconcile(spec, training_args(tmp_path, **SGD_ARGS))

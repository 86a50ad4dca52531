"""``ProTrainTrainer`` on two gloo ranks against a plain ``Trainer`` (DDP through accelerate) with
the same TrainingArguments: logged losses, gradient norms and learning rates, the eval loss and
the logits of the model ``save_model`` gathered and rank 0 wrote are the Trainer's within
rounding; a run resumed from a ``checkpoint-N`` on two ranks ends bit-identical to the
uninterrupted one. Runs are ``tests.hf_trainer_runs.run_trainer`` on every rank."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed.pool import RankPool
from tests.helpers import assert_state_equal
from tests.hf_trainer_runs import run_trainer

RTOL = 1e-5


def test_two_ranks_train_what_the_trainer_trains_with_ddp(rank_pool: RankPool, tmp_path: Path) -> None:
    plain = rank_pool.run(
        run_trainer,
        kind="llama",
        protrain=False,
        output_dir=str(tmp_path / "plain"),
        save_to=str(tmp_path / "p"),
    )
    ours = rank_pool.run(
        run_trainer,
        kind="llama",
        protrain=True,
        output_dir=str(tmp_path / "ours"),
        save_to=str(tmp_path / "o"),
    )
    for rank in (0, 1):  # the Trainer logs the mean over ranks: every rank logs the same
        assert ours[rank]["losses"] == pytest.approx(plain[0]["losses"], rel=RTOL)
        assert ours[rank]["eval_loss"] == pytest.approx(plain[0]["eval_loss"], rel=RTOL)
    reference, result = plain[0], ours[0]
    assert reference["world_size"] == result["world_size"] == 2 and len(result["losses"]) == 20
    assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=RTOL)
    assert result["lrs"] == reference["lrs"]
    bound = RTOL * reference["logits"].abs().max().item()
    assert (result["logits"] - reference["logits"]).abs().max().item() <= bound
    assert_state_equal(ours[1]["state"], ours[0]["state"])  # both ranks read what rank 0 wrote


def test_two_ranks_resume_from_a_checkpoint_bit_identical(rank_pool: RankPool, tmp_path: Path) -> None:
    saving = {"save_strategy": "steps", "save_steps": 10}
    whole = rank_pool.run(
        run_trainer,
        kind="gpt2",
        protrain=True,
        output_dir=str(tmp_path / "whole"),
        save_to=str(tmp_path / "w"),
        **saving,
    )
    stopped = tmp_path / "resumed"
    stopped.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-10", stopped / "checkpoint-10")
    resumed = rank_pool.run(
        run_trainer,
        kind="gpt2",
        protrain=True,
        output_dir=str(stopped),
        save_to=str(tmp_path / "r"),
        resume=True,
        **saving,
    )
    for rank in (0, 1):
        assert resumed[rank]["resumed_from"] is not None and resumed[rank]["global_step"] == 20
        assert resumed[rank]["losses"] == whole[rank]["losses"]
    assert_state_equal(resumed[0]["state"], whole[0]["state"])


def test_two_ranks_save_the_trained_lora_adapter(rank_pool: RankPool, tmp_path: Path) -> None:
    """The ZeRO-3 trap (peft#2500, trl#4416: an empty adapter file): every rank gathers, rank 0
    writes the adapter that PeftModel.from_pretrained loads with the plain Trainer's logits."""
    runs = {
        name: rank_pool.run(
            run_trainer,
            kind="llama",
            protrain=name == "ours",
            output_dir=str(tmp_path / name),
            save_to=str(tmp_path / name / "adapter"),
            lora=True,
            max_steps=8,
        )
        for name in ("plain", "ours")
    }
    plain, ours = runs["plain"][0], runs["ours"][0]
    assert ours["losses"] == pytest.approx(plain["losses"], rel=RTOL)
    bound = RTOL * plain["logits"].abs().max().item()
    assert (ours["logits"] - plain["logits"]).abs().max().item() <= bound
    adapter = tmp_path / "ours" / "adapter" / "adapter_model.safetensors"
    assert (
        adapter.stat().st_size
        == (tmp_path / "plain" / "adapter" / "adapter_model.safetensors").stat().st_size
    )


def refusal(*, rank: int, output_dir: str) -> str:
    """On a rank: the SpecError a Trainer without use_cpu=True raises on CPU, or what happened."""
    from protrain.runtime.config.spec_io import SpecError

    try:
        run_trainer(rank=rank, kind="gpt2", protrain=True, output_dir=output_dir, use_cpu=False, max_steps=2)
    except SpecError as err:
        return str(err)
    return "trained"


def test_a_trainer_that_sees_one_process_of_two_is_refused_with_the_fix(rank_pool: RankPool, tmp_path: Path) -> None:
    """torchrun on CPU without use_cpu=True: transformers set up one process while two ranks were
    started, so both ranks trained the same batches and nothing said so (losses identical to one
    rank). Each rank now stops before training, naming the fix."""
    messages = rank_pool.run(refusal, output_dir=str(tmp_path / "out"))
    for message in messages:
        assert "TrainingArguments see 1 process(es) but 2 ranks were started" in message, message
        assert "use_cpu=True" in message


def test_two_ranks_of_trls_sft_trainer_with_the_head_offloaded_train_what_plain_trl_trains(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    """TRL's fused loss reads the offloaded head outside its forward; its gradient is
    reduce-scattered with its chunk's: losses and every trained parameter as plain TRL on DDP."""
    from tests.unit.test_hf_trainer_trl import run_sft

    plain = rank_pool.run(run_sft, plan=None, output_dir=str(tmp_path / "plain"))
    ours = rank_pool.run(run_sft, plan="all-offloaded", output_dir=str(tmp_path / "ours"))
    assert plain[0]["world_size"] == ours[0]["world_size"] == 2
    for rank in (0, 1):
        assert len(ours[rank]["losses"]) == 6
        assert ours[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=RTOL)
    for name, expected in plain[0]["state"].items():
        got = ours[0]["state"][name]
        assert (got - expected).abs().max() <= RTOL * expected.abs().max(), name
    assert_state_equal(ours[1]["state"], ours[0]["state"])

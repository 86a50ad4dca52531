"""``ProTrainMixin`` on TRL's ``SFTTrainer`` (``class ProTrainSFT(ProTrainMixin, SFTTrainer)``):
trains what the plain ``SFTTrainer`` trains, with the LM head's chunk on the device or offloaded,
and TRL's default ``gradient_checkpointing=True`` is refused with the way out.

TRL 1.16 computes the loss with a fused LM head that reads ``lm_head.weight`` without calling the
head's module (what DeepSpeed ZeRO-3 needs ``maybe_gather_lm_head_ctx`` for): the integration
gathers the head from the backbone's end to the model's (runtime/integrations/fused_head.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protrain.runtime.chunks.released import ReleasedParameterError
from protrain.runtime.integrations.hf import ProTrainMixin
from tests.hf_trainer_runs import CausalWindows, tiny_model

trl = pytest.importorskip("trl")

ONE_PERSISTENT_CHUNK = {"memory": {"chunk_size": "1MiB", "n_persist": 1}}
PLANS = {
    "one-persistent-chunk": ONE_PERSISTENT_CHUNK,
    # The head (64 KiB, a chunk of its own) comes last in execution order: offloaded first.
    "head-offloaded": {"memory": {"chunk_size": "64KiB", "n_persist": 1, "n_buffer": 2}},
    "all-offloaded": {"memory": {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2}},
}


class ProTrainSFT(ProTrainMixin, trl.SFTTrainer):
    pass


def tokenizer() -> Any:
    """A word-level tokenizer over the 256 ids (the data come tokenized; TRL wants pad and eos)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t0")


def sft(trainer_class: type, output_dir: Path, plan: dict[str, Any] = ONE_PERSISTENT_CHUNK, **extra: Any) -> Any:
    from datasets import Dataset

    windows = CausalWindows(26)
    data = Dataset.from_dict({"input_ids": [windows[i]["input_ids"].tolist() for i in range(len(windows))]})
    config = trl.SFTConfig(
        output_dir=str(output_dir),
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=1,
        learning_rate=2e-3,
        save_strategy="no",
        seed=7,
        bf16=False,
        max_length=32,
        **{"max_steps": 6, **extra},
    )
    kwargs: dict[str, Any] = {"model": tiny_model("llama"), "args": config, "train_dataset": data}
    if trainer_class is ProTrainSFT:
        kwargs["protrain"] = plan
    return trainer_class(**kwargs, processing_class=tokenizer())


@pytest.mark.parametrize("plan", PLANS)
def test_sft_trainer_with_the_mixin_trains_what_sft_trainer_trains(tmp_path: Path, plan: str) -> None:
    """Losses and the trained head (its gradients, through six AdamW updates) as plain TRL's."""
    plain = sft(trl.SFTTrainer, tmp_path / "plain", gradient_checkpointing=False)
    plain.train()
    ours = sft(ProTrainSFT, tmp_path / "ours", PLANS[plan], gradient_checkpointing=False)
    try:
        ours.train()
        engine = ours.protrain_engine
        assert engine is not None and engine.global_step == 6
        head = engine.chunks.store.chunk_of(ours.model.lm_head.weight)
        assert engine.chunks.chunks[head].persistent == (plan == "one-persistent-chunk")
        trained = engine.state_dict()
    finally:
        ours.end()

    def losses(trainer: Any) -> list[float]:
        return [record["loss"] for record in trainer.state.log_history if "loss" in record]

    assert len(losses(ours)) == 6
    assert losses(ours) == pytest.approx(losses(plain), rel=1e-5)
    assert torch.isfinite(torch.tensor(losses(ours))).all()
    for name, expected in plain.model.state_dict().items():
        assert (trained[name] - expected).abs().max() <= 1e-5 * expected.abs().max(), name


class HeadNorms:
    """A callback that logs the head's norm after every update, gathered or not."""

    def __init__(self, gather: bool) -> None:
        self.gather = gather
        self.norms: list[float] = []

    def callback(self, trainer: Any) -> Any:
        from transformers import TrainerCallback

        reader = self

        class Reader(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
                head = trainer.model.lm_head.weight
                if reader.gather:
                    with trainer.protrain_engine.gathered([head]):
                        reader.norms.append(float(head.norm()))
                else:
                    reader.norms.append(float(head.norm()))

        return Reader()


@pytest.mark.parametrize("gather", [False, True], ids=["bare", "gathered"])
def test_a_callback_reading_the_offloaded_head_is_refused_unless_it_gathers(tmp_path: Path, gather: bool) -> None:
    trainer = sft(ProTrainSFT, tmp_path, PLANS["all-offloaded"], gradient_checkpointing=False, max_steps=2)
    reader = HeadNorms(gather)
    trainer.add_callback(reader.callback(trainer))
    try:
        if not gather:
            with pytest.raises(ReleasedParameterError, match=r"^lm_head.weight was read .*protrain_engine.gathered"):
                trainer.train()
            return
        trainer.train()
        final = trainer.protrain_engine.state_dict()["lm_head.weight"]
    finally:
        trainer.end()
    assert len(reader.norms) == 2 and reader.norms[-1] == pytest.approx(float(final.norm()), rel=1e-6)


def test_trls_default_gradient_checkpointing_is_refused_with_the_way_out(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="set gradient_checkpointing=False"):
        sft(ProTrainSFT, tmp_path)


def run_sft(*, rank: int = 0, plan: str | None, output_dir: str) -> dict[str, Any]:
    """On each rank of the pool (tests/distributed/test_hf_trainer_two_ranks.py): plain TRL
    (``plan`` None; DDP through accelerate) or the mixin under ``PLANS[plan]``; the logged losses
    and the trained parameters."""
    trainer_class, memory = (ProTrainSFT, PLANS[plan]) if plan else (trl.SFTTrainer, ONE_PERSISTENT_CHUNK)
    trainer = sft(trainer_class, Path(output_dir), memory, gradient_checkpointing=False)
    try:
        trainer.train()
        engine = getattr(trainer, "protrain_engine", None)
        state = engine.state_dict() if engine is not None else trainer.model.state_dict()
        return {
            "losses": [record["loss"] for record in trainer.state.log_history if "loss" in record],
            "world_size": trainer.args.world_size,
            "state": {name: tensor.detach().clone() for name, tensor in state.items()},
        }
    finally:
        engine = getattr(trainer, "protrain_engine", None)
        if engine is not None:
            engine.close()  # not trainer.end(): a pool rank's process group outlives the test

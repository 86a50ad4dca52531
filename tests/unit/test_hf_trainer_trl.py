"""``ProTrainMixin`` on TRL's ``SFTTrainer`` (``class ProTrainSFT(ProTrainMixin, SFTTrainer)``):
trains what the plain ``SFTTrainer`` trains, and TRL's default ``gradient_checkpointing=True`` is
refused with the way out.

TRL 1.16 computes the loss with a fused LM head that reads ``lm_head.weight`` without calling the
head's module (as DeepSpeed ZeRO-3 needs ``maybe_gather_lm_head_ctx`` for): the engine gathers a
chunk when its module runs, so the head's chunk is kept on the device here (one chunk, persistent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protrain.runtime.integrations.hf import ProTrainMixin
from tests.hf_trainer_runs import CausalWindows, tiny_model

trl = pytest.importorskip("trl")

ONE_PERSISTENT_CHUNK = {"memory": {"chunk_size": "1MiB", "n_persist": 1}}


class ProTrainSFT(ProTrainMixin, trl.SFTTrainer):
    pass


def tokenizer() -> Any:
    """A word-level tokenizer over the 256 ids (the data come tokenized; TRL wants pad and eos)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t0")


def sft(trainer_class: type, output_dir: Path, **extra: Any) -> Any:
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
        max_steps=6,
        logging_steps=1,
        learning_rate=2e-3,
        save_strategy="no",
        seed=7,
        bf16=False,
        max_length=32,
        **extra,
    )
    kwargs: dict[str, Any] = {"model": tiny_model("llama"), "args": config, "train_dataset": data}
    if trainer_class is ProTrainSFT:
        kwargs["protrain"] = ONE_PERSISTENT_CHUNK
    return trainer_class(**kwargs, processing_class=tokenizer())


def test_sft_trainer_with_the_mixin_trains_what_sft_trainer_trains(tmp_path: Path) -> None:
    plain = sft(trl.SFTTrainer, tmp_path / "plain", gradient_checkpointing=False)
    plain.train()
    ours = sft(ProTrainSFT, tmp_path / "ours", gradient_checkpointing=False)
    try:
        ours.train()
        assert ours.protrain_engine is not None and ours.protrain_engine.global_step == 6
    finally:
        ours.end()

    def losses(trainer: Any) -> list[float]:
        return [record["loss"] for record in trainer.state.log_history if "loss" in record]

    assert len(losses(ours)) == 6
    assert losses(ours) == pytest.approx(losses(plain), rel=1e-5)
    assert torch.isfinite(torch.tensor(losses(ours))).all()


def test_trls_default_gradient_checkpointing_is_refused_with_the_way_out(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="set gradient_checkpointing=False"):
        sft(ProTrainSFT, tmp_path)

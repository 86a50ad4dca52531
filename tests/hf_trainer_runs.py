"""What the Trainer-integration tests share: tiny Hugging Face causal LMs, a map-style dataset of
token windows, TrainingArguments, and one training run of a ``Trainer`` class reduced to what
the tests compare (logged losses, gradient norms and learning rates, eval loss, the saved
model's logits). Run in-process or on pool ranks (``rank`` is the pool's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from protrain_demo.corpus import TokenWindows, stdlib_text_corpus
from tests.helpers import TINY_LLAMA

SEQ_LEN = 32
MEMORY = {"memory": {"chunk_size": "64KiB", "n_persist": 1, "n_buffer": 2}}
"""Some chunks offloaded (both update paths), fixed so that every run plans alike: a resumed run
then continues bit-identically (a plan searched on timings could choose other chunk sizes)."""


class CausalWindows(Dataset[dict[str, torch.Tensor]]):
    """``num_samples`` token windows of the stdlib corpus from ``start``, Hugging Face style
    (``labels`` = ``input_ids``: the model shifts them)."""

    def __init__(self, num_samples: int, start: int = 0) -> None:
        tokens = stdlib_text_corpus()[start * SEQ_LEN : (start + num_samples) * SEQ_LEN]
        self.windows = TokenWindows(tokens, SEQ_LEN - 1)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows.windows[index]
        return {"input_ids": window, "labels": window.clone()}


def tiny_model(kind: str) -> torch.nn.Module:
    """A two-layer Llama (no dropout) or GPT-2 (dropout 0.1 as its default: the random streams
    must advance alike) with seed 0."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    config = GPT2Config(vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def lora_model(kind: str) -> torch.nn.Module:
    """LoRA on the attention projections of ``tiny_model(kind)``, the head trained whole
    (``modules_to_save``), the adapters drawn with seed 1."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "v_proj"] if kind == "llama" else ["c_attn"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=["lm_head"])
    model = tiny_model(kind)
    torch.manual_seed(1)
    return get_peft_model(model, config)


def reload_lora(kind: str, path: str) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(tiny_model(kind), path)


def training_args(output_dir: str | Path, **extra: Any) -> Any:
    """26 samples in micro-batches of 2 make 13 per epoch: with accumulation 2, each epoch ends
    in a window of one micro-batch (the short window the engine is told about)."""
    from transformers import TrainingArguments

    values: dict[str, Any] = {
        "output_dir": str(output_dir),
        "report_to": [],
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 20,
        "logging_steps": 1,
        "learning_rate": 2e-3,
        "weight_decay": 0.1,
        "warmup_steps": 3,
        "lr_scheduler_type": "cosine",
        "max_grad_norm": 0.5,
        "save_strategy": "no",
        "seed": 7,
        **extra,
    }
    return TrainingArguments(**values)


def run_trainer(
    *,
    rank: int = 0,
    kind: str,
    protrain: bool,
    output_dir: str,
    spec: dict[str, Any] | None = None,
    resume: bool = False,
    save_to: str | None = None,
    lora: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """Train ``tiny_model(kind)`` with a plain ``Trainer`` or a ``ProTrainTrainer`` (``spec``:
    its ``protrain=``, MEMORY by default), evaluate and predict, and with ``save_to`` save the model there
    and reload it with ``from_pretrained`` (``lora``: a PEFT LoRA model, its adapter saved and
    reloaded with ``PeftModel.from_pretrained``). Returns the logged training records, the eval loss,
    the reloaded model's logits on an eval batch, and the final parameters."""
    from transformers import AutoModelForCausalLM, Trainer

    from protrain.runtime.integrations.hf import ProTrainTrainer

    kwargs: dict[str, Any] = {
        "model": lora_model(kind) if lora else tiny_model(kind),
        "args": training_args(output_dir, **extra),
        "train_dataset": CausalWindows(26),
        "eval_dataset": CausalWindows(6, start=26),
    }
    trainer = ProTrainTrainer(**kwargs, protrain=spec or MEMORY) if protrain else Trainer(**kwargs)
    try:
        trainer.train(resume_from_checkpoint=resume or None)
        records = [r for r in trainer.state.log_history if "loss" in r]
        result: dict[str, Any] = {
            "losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records],
            "lrs": [r["learning_rate"] for r in records],
            "eval_loss": trainer.evaluate()["eval_loss"],
            "predict_loss": trainer.predict(CausalWindows(4, start=26)).metrics["test_loss"],
            "global_step": trainer.state.global_step,
            "world_size": trainer.args.world_size,
        }
        engine = getattr(trainer, "protrain_engine", None)
        if engine is not None:
            result["resumed_from"] = None if engine.resumed_from is None else str(engine.resumed_from)
        if save_to is not None:
            trainer.save_model(save_to)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # rank 0 writes; every rank reads it back
            reloaded = (
                reload_lora(kind, save_to) if lora else AutoModelForCausalLM.from_pretrained(save_to)
            ).eval()
            with torch.no_grad():
                batch = CausalWindows(2, start=26)[0]["input_ids"][None]
                result["logits"] = reloaded(input_ids=batch).logits
            result["state"] = {k: v.detach().clone() for k, v in reloaded.state_dict().items()}
        return result
    finally:
        engine = getattr(trainer, "protrain_engine", None)
        if engine is not None:
            engine.close()  # not trainer.end(): a pool rank's process group outlives the test

"""Fine-tune a small causal LM with LoRA through the Hugging Face Trainer, trained by ProTrain.

    python scripts/finetune_hf.py                          # about a minute on 2 CPU cores
    python scripts/finetune_hf.py --base DIR --out OUT     # a saved Hugging Face model of yours
    protrain-run --nproc-per-node 2 scripts/finetune_hf.py --config job.yaml

The model: a Hugging Face Llama built from a config object (4 layers of width 128, a byte-level
vocabulary of 256; no download), or ``--base DIR`` (what ``save_pretrained`` wrote, e.g.
``scripts/train_lm.py --arch llama --export DIR``). LoRA (``peft``) on the attention's query and
value projections, the head trained whole (``modules_to_save``). The data: byte-level windows of
Python's own help text, the last tenth held out for evaluation. ``ProTrainTrainer`` is
``transformers.Trainer`` training through the engine: the spec (``--config``, or the one
protrain-run passes, or ``--device-budget``) places the frozen base, the adapters and the
activations; the TrainingArguments below give the optimizer and schedule.

At the end the adapter is saved (``trainer.save_model``: PEFT's adapter directory), reloaded on
a fresh copy of the base with ``PeftModel.from_pretrained``, and evaluated again: the script
prints the eval loss before training, after, and of the reloaded adapter, which must agree with
the trained one.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from protrain_demo.corpus import TokenWindows, stdlib_text_corpus  # noqa: E402

SEQ_LEN = 128
BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ_LEN,
)


class ByteWindows(Dataset[dict[str, torch.Tensor]]):
    """Token windows of ``tokens``, Hugging Face style (``labels`` = ``input_ids``: the model
    shifts them)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.windows = TokenWindows(tokens, SEQ_LEN - 1)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows.windows[index]
        return {"input_ids": window, "labels": window.clone()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="a saved Hugging Face causal LM (default: built here)")
    parser.add_argument("--out", type=Path, help="output directory (default: runs/finetune_hf)")
    parser.add_argument("--config", help="ProTrain job spec (default: protrain-run's, else --device-budget)")
    parser.add_argument("--device-budget", default="24MiB", help="memory.device_budget without --config")
    parser.add_argument("--steps", type=int, default=100, help="optimizer updates")
    parser.add_argument("--samples", type=int, default=800, help="training windows of the corpus")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--smoke", action="store_true", help="a few tiny steps (a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.samples = 3, 40
    if args.out is None:
        # A smoke run leaves nothing behind in the repository.
        args.out = Path(tempfile.mkdtemp(prefix="finetune-hf-")) if args.smoke else Path("runs/finetune_hf")
    return args


def base_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.base is not None:
        return AutoModelForCausalLM.from_pretrained(args.base)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**BASE_CONFIG))


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]
    )
    torch.manual_seed(1)
    return get_peft_model(model, config)


def datasets(samples: int) -> tuple[ByteWindows, ByteWindows]:
    tokens = stdlib_text_corpus()
    held_out = max(SEQ_LEN * 8, samples * SEQ_LEN // 9)
    train = tokens[: samples * SEQ_LEN]
    evaluation = tokens[len(tokens) - held_out :]
    return ByteWindows(train), ByteWindows(evaluation)


def protrain_spec(args: argparse.Namespace) -> Any:
    """``--config``, else protrain-run's spec (None lets the Trainer find it), else a budget."""
    import os

    if args.config is not None:
        return args.config
    if os.environ.get("PROTRAIN_SPEC"):
        return None
    return {"memory": {"device_budget": args.device_budget}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return finetune(args)
    finally:
        if args.smoke:
            shutil.rmtree(args.out, ignore_errors=True)


def finetune(args: argparse.Namespace) -> int:
    from peft import PeftModel
    from transformers import TrainingArguments

    from protrain.runtime.integrations.hf import ProTrainTrainer

    train, evaluation = datasets(args.samples)
    model = with_lora(base_model(args), args.rank)
    training = TrainingArguments(
        output_dir=str(args.out),
        max_steps=args.steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=max(1, args.steps // 10),
        lr_scheduler_type="cosine",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=max(1, args.steps // 6),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=7,
    )
    trainer = ProTrainTrainer(
        model=model, args=training, train_dataset=train, eval_dataset=evaluation, protrain=protrain_spec(args)
    )
    try:
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        after = trainer.evaluate()["eval_loss"]
        adapter = args.out / "adapter"
        trainer.save_model(str(adapter))
    finally:
        trainer.end()
    if not trainer.is_world_process_zero():
        return 0
    reloaded = PeftModel.from_pretrained(base_model(args), str(adapter)).eval()
    reloaded_loss = evaluate(reloaded, evaluation)
    files = sorted(p.name for p in adapter.iterdir())
    print(
        f"eval loss: {before:.4f} before, {after:.4f} after {args.steps} updates (perplexity "
        f"{math.exp(before):.1f} -> {math.exp(after):.1f}); the adapter reloaded with "
        f"PeftModel.from_pretrained: {reloaded_loss:.4f}"
    )
    print(f"adapter: {adapter} ({', '.join(files)})")
    if not math.isclose(reloaded_loss, after, rel_tol=1e-4):
        print("the reloaded adapter does not give the trained model's eval loss", file=sys.stderr)
        return 1
    return 0


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ByteWindows) -> float:
    """Mean loss over ``data`` in batches of 8, as Trainer's evaluation averages it."""
    losses, counts = [], []
    for start in range(0, len(data), 8):
        items = [data[i] for i in range(start, min(start + 8, len(data)))]
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        losses.append(model(**batch).loss.item() * len(items))
        counts.append(len(items))
    return sum(losses) / sum(counts)


if __name__ == "__main__":
    raise SystemExit(main())

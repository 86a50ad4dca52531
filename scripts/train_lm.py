"""Train a causal language model with ProTrain.

    protrain-run --nproc-per-node 2 scripts/train_lm.py --config configs/demo-cpu.yaml

Models: the repo's GPT (``--arch gpt --preset tiny|demo|gpt2-124m``) or a Hugging Face Llama
built from a config object (``--arch llama --preset tiny|7b|70b``; needs ``transformers``, random
initialisation, no download). Data: byte-level windows of Python's own help text (for the GPT
presets with vocabulary 256), or random tokens for the other vocabularies.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch import nn

import runtime
from runtime.data import LMBatches, stdlib_text_corpus
from runtime.models.gpt import GPT, PRESETS

LLAMA_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    "7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
    "70b": dict(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    ),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--preset", default="demo", help="model size (see the module docstring)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's)")
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer updates (default: scheduler.total_steps)"
    )
    return parser.parse_args()


def build_model(arch: str, preset: str) -> tuple[nn.Module, int, int]:
    """(model, vocabulary size, maximum sequence length)."""
    if arch == "gpt":
        if preset not in PRESETS:
            raise SystemExit(f"--preset for gpt must be one of {sorted(PRESETS)}")
        config = PRESETS[preset]
        return GPT(config), config.vocab_size, config.seq_len
    if preset not in LLAMA_PRESETS:
        raise SystemExit(f"--preset for llama must be one of {sorted(LLAMA_PRESETS)}")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_PRESETS[preset], attention_dropout=0.0)
    return LlamaForCausalLM(config), config.vocab_size, config.max_position_embeddings


def token_source(vocab_size: int, seed: int) -> torch.Tensor:
    if vocab_size == 256:
        return stdlib_text_corpus()
    return torch.randint(0, vocab_size, (1 << 22,), generator=torch.Generator().manual_seed(seed))


def main() -> None:
    args = parse_args()
    spec = runtime.current_spec()
    torch.manual_seed(spec.seed)
    model, vocab_size, max_seq_len = build_model(args.arch, args.preset)
    seq_len = args.seq_len or min(max_seq_len, 512)
    data = LMBatches(
        tokens=token_source(vocab_size, spec.seed),
        seq_len=seq_len,
        micro_batch_size=spec.micro_batch_size,
        gradient_accumulation_steps=spec.gradient_accumulation_steps,
        world_size=1,
        seed=spec.seed,
    )
    engine = runtime.initialize(model, example_batch=data.batch(0, 0, 0))
    # Each rank takes its own slice of every update's global batch.
    data = dataclasses.replace(data, world_size=engine.world_size)
    steps = args.steps or spec.scheduler.total_steps or 100
    with engine:
        for update in range(steps):
            for micro in range(engine.gradient_accumulation_steps):
                batch = {k: v.to(engine.device) for k, v in data.batch(update, micro, engine.rank).items()}
                out = engine(**batch)
                engine.backward(out.loss)
                engine.step()
        engine.log(f"done: {engine.global_step} updates, {engine.skipped_steps} skipped")


if __name__ == "__main__":
    main()

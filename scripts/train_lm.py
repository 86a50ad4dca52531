"""Train a causal language model with ProTrain.

    protrain-run --nproc-per-node 2 scripts/train_lm.py --config configs/demo-cpu.yaml

Models: the repo's GPT (``--arch gpt --preset tiny|demo|gpt2-124m``) or a Hugging Face Llama
built from a config object (``--arch llama --preset tiny|7b|70b``; needs ``transformers``, random
initialisation, no download). Data: byte-level windows of Python's own help text (for the GPT
presets with vocabulary 256), or random tokens for the other vocabularies, read through the
engine's resumable data loader: with ``checkpoint.dir`` set, a stopped or restarted job resumes
where it was, on the same batches. ``--export PATH`` writes the trained weights (safetensors, or
a Hugging Face directory for ``--arch llama``).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import runtime
from runtime.data import TokenWindows, stdlib_text_corpus
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
    parser.add_argument("--export", default=None, help="write the trained weights here at the end")
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
    dataset = TokenWindows(token_source(vocab_size, spec.seed), seq_len)
    engine = runtime.initialize(model, example_batch=dataset.first_batch(spec.micro_batch_size))
    steps = args.steps or spec.scheduler.total_steps or 100
    with engine:
        # Each rank reads its own share of every update's global batch, epoch after epoch.
        loader = engine.data_loader(dataset)
        while engine.global_step < steps:
            for batch in loader:
                out = engine(**{k: v.to(engine.device) for k, v in batch.items()})
                engine.backward(out.loss)
                engine.step()
                if engine.global_step >= steps:
                    break
        engine.log(f"done: {engine.global_step} updates, {engine.skipped_steps} skipped")
        if args.export:
            engine.export(args.export, hf=args.arch == "llama")


if __name__ == "__main__":
    main()

"""What the GPT benchmarks share: the model from its size arguments and fixed batches."""

from __future__ import annotations

import argparse
import math

import torch

from protrain_demo.corpus import LMBatches, stdlib_text_corpus
from protrain_demo.gpt import GPT, GPTConfig

SEED = 1234
Batch = dict[str, torch.Tensor]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks")
    parser.add_argument("--width", type=int, default=512, help="model width (d_model)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=4, help="samples per step")


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab_size=256, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.width
    )


def build_gpt(config: GPTConfig) -> GPT:
    """The same initial weights on every call."""
    torch.manual_seed(SEED)
    return GPT(config)


def make_batches(args: argparse.Namespace, count: int) -> list[Batch]:
    """``count`` byte-level batches of Python's help text, fixed by the seed."""
    data = LMBatches(
        tokens=stdlib_text_corpus(),
        seq_len=args.seq_len,
        micro_batch_size=args.batch,
        gradient_accumulation_steps=1,
        world_size=1,
        seed=SEED,
    )
    return [data.batch(update, 0, 0) for update in range(count)]


CHUNK_ALIGN_BYTES = 4096


def derive_chunk_size(model: GPT, min_chunks: int) -> int:
    """Bytes per chunk so that the fp32 model needs at least ``min_chunks`` chunks (whole
    parameters per chunk waste some room, so aim a little above) while its largest parameter
    still fits one chunk; a multiple of a page."""
    sizes = [p.numel() * 4 for p in model.parameters()]
    target = max(max(sizes), sum(sizes) // (min_chunks + 2))
    return math.ceil(target / CHUNK_ALIGN_BYTES) * CHUNK_ALIGN_BYTES

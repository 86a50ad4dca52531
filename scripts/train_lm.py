"""Train a causal language model with ProTrain.

    protrain-run --nproc-per-node 2 scripts/train_lm.py --config configs/demo-cpu.yaml

Models: the repo's GPT (``--arch gpt --preset tiny|demo|gpt2-124m``) or a Hugging Face Llama
built from a config object (``--arch llama --preset tiny|7b|70b``; needs ``transformers``, no
download). Data: byte-level windows of Python's own help text (for the GPT presets with
vocabulary 256), or random tokens for the other vocabularies, read through the engine's
resumable data loader: with ``checkpoint.dir`` set, a stopped or restarted job resumes where it
was, on the same batches. ``--export PATH`` writes the trained weights (safetensors, or a Hugging
Face directory for ``--arch llama``).

How the model is built (``--init``):
  whole   built in host memory at fp32 under ``torch.manual_seed(seed)``, then handed to
          ``runtime.initialize``, which moves it to the device and chunks it.
  chunks  built on the meta device (accelerate's ``init_empty_weights``) and never materialised
          whole: ``runtime.initialize(..., weights=ModelInit(model, seed=seed))`` fills it chunk by
          chunk, each parameter initialised as the model's own constructor would (seeded by the
          job's seed and the parameter's name, so every rank gets the same values; they differ
          from a whole build's), and profiles it through its chunks.
  auto    (default) chunks when the model's fp32 parameters take more than
          ``memory.device_budget`` (when the spec sets a number) or more than 4 GiB (when it is
          auto), else whole: the Llama 7B (25 GiB) and 70B presets stream, the GPT presets (at
          most 0.5 GiB) are built whole.
``--weights DIR`` (a directory of ``*.safetensors`` shards, as ``save_pretrained`` writes, names
as the model's ``state_dict``) builds on the meta device and reads each parameter from the shards
into its chunk, whatever ``--init`` says.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from protrain import runtime
from protrain.runtime.config.spec import AUTO, Spec
from protrain_demo.corpus import TokenWindows, stdlib_text_corpus
from protrain_demo.gpt import GPT, PRESETS
from protrain.runtime.model_io.weights import ModelInit, WeightsSource

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


WHOLE_BUILD_MAX_BYTES = 4 << 30
"""With ``memory.device_budget: auto``, ``--init auto`` builds a model whole up to this many
bytes of fp32 parameters (any GPU holds that, and host memory holds it twice)."""


@dataclass(frozen=True, slots=True)
class BuiltModel:
    model: nn.Module
    weights: WeightsSource | None
    """Where ``initialize`` reads the parameters of a model built on the meta device; None: built whole."""
    vocab_size: int
    max_seq_len: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--preset", default="demo", help="model size (see the module docstring)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's)")
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer updates (default: scheduler.total_steps)"
    )
    parser.add_argument(
        "--init",
        choices=("auto", "whole", "chunks"),
        default="auto",
        help="build the model whole, or on the meta device filled chunk by chunk (see above)",
    )
    parser.add_argument(
        "--weights", type=Path, default=None, metavar="DIR", help="a directory of safetensors shards to load"
    )
    parser.add_argument("--export", default=None, help="write the trained weights here at the end")
    return parser.parse_args(argv)


def model_factory(arch: str, preset: str) -> tuple[Callable[[], nn.Module], int, int]:
    """(a constructor of the model, vocabulary size, maximum sequence length)."""
    if arch == "gpt":
        if preset not in PRESETS:
            raise SystemExit(f"--preset for gpt must be one of {sorted(PRESETS)}")
        config = PRESETS[preset]
        return lambda: GPT(config), config.vocab_size, config.seq_len
    if preset not in LLAMA_PRESETS:
        raise SystemExit(f"--preset for llama must be one of {sorted(LLAMA_PRESETS)}")
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(**LLAMA_PRESETS[preset], attention_dropout=0.0)
    return lambda: LlamaForCausalLM(llama), llama.vocab_size, llama.max_position_embeddings


def builds_on_meta(parameter_bytes: int, *, device_budget: int | str, init: str) -> bool:
    """Whether ``--init`` (auto: by size against the device budget) asks for the meta device."""
    if init != "auto":
        return init == "chunks"
    limit = WHOLE_BUILD_MAX_BYTES if device_budget == AUTO else int(device_budget)
    return parameter_bytes > limit


def build_model(arch: str, preset: str, *, spec: Spec, init: str, weights: Path | None) -> BuiltModel:
    """The model, on the meta device with a weights source when it is too large to build whole
    (or ``--init chunks``, or ``--weights``), else built whole at fp32 from the job's seed."""
    from accelerate import init_empty_weights

    factory, vocab_size, max_seq_len = model_factory(arch, preset)
    # Buffers stay real (rotary tables, ...): initialize keeps them and reads only parameters.
    with init_empty_weights(include_buffers=False):
        empty = factory()
    parameter_bytes = sum(p.numel() * 4 for p in empty.parameters())  # fp32, as built
    if weights is not None:
        return BuiltModel(empty, weights, vocab_size, max_seq_len)
    if builds_on_meta(parameter_bytes, device_budget=spec.memory.device_budget, init=init):
        return BuiltModel(empty, ModelInit(empty, seed=spec.seed), vocab_size, max_seq_len)
    torch.manual_seed(spec.seed)
    return BuiltModel(factory(), None, vocab_size, max_seq_len)


def token_source(vocab_size: int, seed: int) -> torch.Tensor:
    if vocab_size == 256:
        return stdlib_text_corpus()
    return torch.randint(0, vocab_size, (1 << 22,), generator=torch.Generator().manual_seed(seed))


def describe(built: BuiltModel) -> str:
    parameters = sum(p.numel() for p in built.model.parameters())
    fp32_mib = parameters * 4 / 2**20
    size = f"{parameters / 1e6:,.2f}M parameters, " + (
        f"{fp32_mib:.1f} MiB at fp32" if fp32_mib < 1024 else f"{fp32_mib / 1024:.1f} GiB at fp32"
    )
    if built.weights is None:
        return f"model: {size}, built whole"
    source = built.weights if isinstance(built.weights, Path) else "initialised per parameter"
    return f"model: {size}, built on the meta device and filled chunk by chunk ({source})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spec = runtime.current_spec()
    built = build_model(args.arch, args.preset, spec=spec, init=args.init, weights=args.weights)
    seq_len = args.seq_len or min(built.max_seq_len, 512)
    if seq_len > built.max_seq_len:
        raise SystemExit(f"--seq-len {seq_len} exceeds the {args.preset} preset's {built.max_seq_len}")
    dataset = TokenWindows(token_source(built.vocab_size, spec.seed), seq_len)
    summary = describe(built)  # before initialize swaps the parameters for chunk views
    engine = runtime.initialize(
        built.model, example_batch=dataset.first_batch(spec.micro_batch_size), weights=built.weights
    )
    steps = args.steps or spec.scheduler.total_steps or 100
    with engine:
        engine.log(summary)
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

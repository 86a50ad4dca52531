"""What the checkpoint tests share: a tiny map-style LM dataset and a training loop that reads it
through ``engine.data_sampler`` (as a user script would), run in-process or on pool ranks."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from protrain_demo.corpus import TokenWindows, stdlib_text_corpus
from protrain_demo.gpt import GPTConfig
from tests.helpers import TINY_GPT, tiny_gpt

SEQ_LEN = 32
# Dropout on: resuming must restore each rank's random stream, not only the weights.
DROPOUT_GPT = dataclasses.replace(TINY_GPT, dropout=0.1)


def Windows(num_samples: int = 96) -> TokenWindows:  # noqa: N802 - reads as the dataset it builds
    """The first ``num_samples`` windows of the stdlib corpus."""
    return TokenWindows(stdlib_text_corpus()[: num_samples * (SEQ_LEN + 1)], SEQ_LEN)


def checkpoint_job(root: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "seed": 5,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 2e-3, "weight_decay": 0.1},
        "scheduler": {"type": "warmup_cosine", "warmup_steps": 2, "total_steps": 12},
        "memory": {"chunk_size": "64KiB", "n_persist": 1, "n_buffer": 2},
        "checkpoint": {"dir": f"{root}/ckpt"},
        "output_dir": f"{root}/runs",
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def train_until(
    config: dict[str, Any],
    *,
    until: int,
    seed: int = 0,
    dropout: bool = True,
    resave_to: str | None = None,
    model_config: GPTConfig | None = None,
    rank: int = 0,
) -> dict[str, Any]:
    """Build the model, ``initialize`` (resuming per the spec), train through the engine's data
    sampler until ``until`` updates are done; the losses of the updates run here, the final
    consolidated state and where the run resumed from. ``resave_to``: save a checkpoint there
    right after initialize (what was loaded, as this layout writes it). ``model_config``: instead
    of the tiny GPT (with dropout unless ``dropout`` is False). ``rank`` is ignored: the rank pool
    passes it."""
    from protrain import runtime

    torch.manual_seed(seed)
    model = tiny_gpt(seed, model_config or (DROPOUT_GPT if dropout else TINY_GPT))
    engine = runtime.initialize(model, config=config)
    losses: list[float] = []
    with engine:
        started_at = engine.global_step
        if resave_to is not None:
            engine.save_checkpoint(resave_to)
        dataset = Windows()
        loader = engine.data_loader(dataset)
        window = 0.0
        while engine.global_step < until:
            for batch in loader:
                out = engine(**batch)
                engine.backward(out.loss)
                window += out.loss.item()
                if engine.step():
                    losses.append(window)
                    window = 0.0
                elif engine.micro_step % engine.gradient_accumulation_steps == 0:
                    window = 0.0
                if engine.global_step >= until:
                    break
        return {
            "losses": losses,
            "state": engine.state_dict(),
            "started_at": started_at,
            "resumed_from": None if engine.resumed_from is None else str(engine.resumed_from),
            "world_size": engine.world_size,
            "offloaded_chunks": engine.plan.num_chunks - engine.plan.n_persist,
        }


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as one full tensor, read by torch's own converter (not by
    ProTrain's loader): what the tests compare checkpoints with."""
    import tempfile
    from pathlib import Path

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "full.pt"
        dcp_to_torch_save(path, target)
        state = torch.load(target, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.startswith("rng.")}

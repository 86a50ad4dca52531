"""Encoder-decoder models (Hugging Face T5 and BART from config objects, no downloads) train like
plain PyTorch with a recomputed block at every position, encoder and decoder: the engine turns
the model's key/value cache off in training (runtime.model_cache), which otherwise makes a
recomputed decoder block differ from its forward (torch.utils.checkpoint.CheckpointError)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from protrain import runtime
from tests.helpers import adamw_decaying_by_name, assert_state_close, assert_state_equal

transformers = pytest.importorskip("transformers")

VOCAB = 128
NUM_BLOCKS = 4  # two encoder blocks, then two decoder blocks
STEPS = 2
OTHER_MODES = ("ssd", "swap", "keep")


def tiny_t5() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def tiny_bart() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    return transformers.BartForConditionalGeneration(config)


Batch = dict[str, torch.Tensor]
StateCheck = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None]


@dataclass(frozen=True)
class Seq2Seq:
    """A model, how its batches are fed and its loss taken, and the oracle its training meets."""

    build: Callable[[], nn.Module]
    with_labels: bool
    """True: the model takes ``labels`` and returns the loss. False: the script passes
    ``decoder_input_ids`` and takes the loss from the logits (BART given ``labels`` turns its
    cache off by itself; given decoder inputs it fills the cache, as T5 does either way)."""
    oracle: StateCheck

    def batches(self, num: int) -> list[tuple[Batch, torch.Tensor]]:
        """(model inputs, targets) for ``num`` updates."""
        generator = torch.Generator().manual_seed(5)
        result = []
        for _ in range(num):
            source = torch.randint(3, VOCAB, (2, 16), generator=generator)
            target = torch.randint(3, VOCAB, (2, 9), generator=generator)
            labels = target[:, 1:].contiguous()
            if self.with_labels:
                result.append(({"input_ids": source, "labels": labels}, labels))
            else:
                result.append(({"input_ids": source, "decoder_input_ids": target[:, :-1]}, labels))
        return result

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.with_labels:
            return output.loss
        return nn.functional.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


MODELS = {
    # T5 ties one embedding to three uses (encoder, decoder, head): the engine sums their
    # gradients in another order, so it is equal within DESIGN section 6's tolerance.
    "t5": Seq2Seq(build=tiny_t5, with_labels=True, oracle=assert_state_close),
    # BART's gradients are summed in the same order: bit-exact. (Its attention key biases have a
    # cancellation-noise gradient, on which no relative tolerance holds: the bit-exact check is
    # the one that states their equality.)
    "bart": Seq2Seq(build=tiny_bart, with_labels=False, oracle=assert_state_equal),
}


def modes_with_checkpoint_at(position: int) -> list[str]:
    """``checkpoint`` at ``position``; the other blocks ssd, swap and keep in turn, so every
    offload mode runs beside the recomputed block, in the encoder and the decoder."""
    others = iter(OTHER_MODES)
    return ["checkpoint" if index == position else next(others) for index in range(NUM_BLOCKS)]


def train_reference(case: Seq2Seq) -> dict[str, torch.Tensor]:
    """Plain PyTorch, torch.optim.AdamW with the spec's default decay rule (no decay for biases
    and norms: both models' norm parameters have "norm" in their names)."""
    model = case.build()
    optimizer = adamw_decaying_by_name(model, ("bias", "norm"))
    for batch, targets in case.batches(STEPS):
        case.loss(model(**batch), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_config(tmp_path: Path, block_modes: list[str]) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {
            "chunk_size": "16KiB",
            "n_persist": 0,
            "n_buffer": 2,
            "ssd": {"path": str(tmp_path / "act")},
            "block_modes": block_modes,
        },
        "profiler": {"cache_dir": str(tmp_path / "cache")},
        "output_dir": str(tmp_path / "runs"),
    }


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    """Each model's plain-PyTorch result, trained once for every block layout."""
    return {kind: train_reference(case) for kind, case in MODELS.items()}


@pytest.mark.parametrize("position", range(NUM_BLOCKS))
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_recomputed_block_anywhere_trains_like_pytorch(
    tmp_path: Path, references: dict[str, dict[str, torch.Tensor]], kind: str, position: int
) -> None:
    case = MODELS[kind]
    modes = modes_with_checkpoint_at(position)
    engine = runtime.initialize(case.build(), config=engine_config(tmp_path, modes))
    with engine:
        assert [mode.value for mode in engine.plan.block_modes] == modes
        for batch, targets in case.batches(STEPS):
            engine.backward(case.loss(engine(**batch), targets))
            engine.step()
        case.oracle(engine.state_dict(), references[kind])


def test_training_turns_the_cache_off_says_so_once_and_eval_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_t5()
    batches = [batch for batch, _ in MODELS["t5"].batches(2)]
    engine = runtime.initialize(model, config=engine_config(tmp_path, ["keep", "keep", "checkpoint", "keep"]))
    with engine:
        for batch in batches:
            output = engine(**batch)
            assert output.past_key_values is None  # no cache was filled
            engine.backward(output.loss)
            engine.step()
        out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
        assert out.count("use_cache=False in training") == 1
        # The model's own settings are untouched: evaluation and generation keep the cache.
        assert model.config.use_cache and model.decoder.config.use_cache
        engine.eval()
        with torch.no_grad():
            assert engine(**batches[0]).past_key_values is not None


def test_an_explicit_cache_with_recomputed_blocks_is_refused_before_forward(tmp_path: Path) -> None:
    modes = ["keep", "keep", "checkpoint", "keep"]
    engine = runtime.initialize(tiny_bart(), config=engine_config(tmp_path, modes))
    with engine:
        with pytest.raises(ValueError, match="use_cache=True in a training forward while the plan"):
            engine(**MODELS["bart"].batches(1)[0][0], use_cache=True)


def test_profiling_runs_the_decoder_without_its_cache(tmp_path: Path) -> None:
    """The profiling steps measure the model as it is trained: the decoder stack (which owns a
    copy of the config) sees use_cache off in every profiled forward."""
    model = tiny_t5()
    seen: list[bool] = []

    def note(module: nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled():  # a profiling step (the first-use order is recorded without grad)
            seen.append(module.config.use_cache)

    model.decoder.register_forward_pre_hook(note)
    config = engine_config(tmp_path, ["keep"] * NUM_BLOCKS)
    del config["memory"]["block_modes"]  # activation modes left to the search: profiled
    config["memory"]["ssd"] = {"path": None}
    engine = runtime.initialize(model, config=config, example_batch=MODELS["t5"].batches(1)[0][0])
    with engine:
        assert seen and not any(seen)
        assert model.decoder.config.use_cache

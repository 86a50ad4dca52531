"""Block-wise activation modes: keep, swap, checkpoint and ssd give bit-identical training to the
same engine keeping every activation (and plain PyTorch within DESIGN's tolerance), on the
repo's GPT and tiny Hugging Face GPT-2 and Llama; saved storages travel once and come back as the
exact views that were saved; in-place changes to saved tensors raise; activation files go away."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from protrain import runtime
from protrain.runtime.activations.records import SavedTensorModifiedError
from protrain.runtime.config.spec_io import SpecError
from protrain_demo.gpt import GPTConfig
from tests.helpers import assert_state_close, assert_state_equal, lm_batches, tiny_gpt, train_reference

STEPS = 4
FOUR_BLOCKS = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=2, d_model=64)


def job(tmp_path: Path, modes: list[str] | None, **memory: Any) -> dict[str, Any]:
    memory_spec: dict[str, Any] = {"block_modes": modes, **memory}
    if modes is not None and "ssd" in modes:
        memory_spec["ssd"] = {"path": str(tmp_path / "ssd")}
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": memory_spec,
        "output_dir": str(tmp_path / "runs"),
    }


def train(engine: Any, steps: int, *, batch_fn: Any = None) -> list[float]:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    losses = []
    for update in range(steps):
        batch = data.batch(update, 0, 0)
        out = engine(**(batch_fn(batch) if batch_fn else batch))
        loss = out if isinstance(out, torch.Tensor) else out.loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def trained_state(tmp_path: Path, model: nn.Module, modes: list[str] | None, **memory: Any) -> dict[str, Any]:
    engine = runtime.initialize(model, config=job(tmp_path, modes, **memory))
    try:
        train(engine, STEPS)
        assert engine.activations.live_records == 0, "every offloaded activation was released"
        return engine.state_dict()
    finally:
        engine.close()


MIXES = [
    ["swap"] * 4,
    ["checkpoint"] * 4,
    ["ssd"] * 4,
    ["ssd", "swap", "checkpoint", "keep"],
    ["swap", "checkpoint", "swap", "keep"],
]


@pytest.mark.parametrize("modes", MIXES, ids=["-".join(m) for m in MIXES])
def test_modes_train_bit_identically_to_keeping_everything(tmp_path: Path, modes: list[str]) -> None:
    kept = trained_state(tmp_path / "keep", tiny_gpt(config=FOUR_BLOCKS), ["keep"] * 4)
    moved = trained_state(tmp_path / "moved", tiny_gpt(config=FOUR_BLOCKS), modes)
    assert_state_equal(moved, kept)


def test_modes_with_offloaded_chunks_match_plain_pytorch(tmp_path: Path) -> None:
    """Recomputation and saved-tensor offload while chunks pass through two buffers (slots are
    reused between a block's forward, its recomputation and its backward)."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(config=FOUR_BLOCKS), data, steps=STEPS, lr=1e-3, weight_decay=0.1)
    modes = ["ssd", "checkpoint", "swap", "checkpoint"]
    memory = {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2}
    got = trained_state(tmp_path, tiny_gpt(config=FOUR_BLOCKS), modes, **memory)
    assert_state_close(got, expected)
    kept = trained_state(tmp_path / "keep", tiny_gpt(config=FOUR_BLOCKS), ["keep"] * 4, **memory)
    assert_state_equal(got, kept)


def tiny_hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=256,
                n_positions=32,
                n_embd=64,
                n_layer=3,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )


def hf_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_models_train_bit_identically_under_every_mode(tmp_path: Path, kind: str) -> None:
    states = []
    for name, modes in (("keep", ["keep"] * 3), ("mixed", ["ssd", "swap", "checkpoint"])):
        engine = runtime.initialize(tiny_hf(kind), config=job(tmp_path / name, modes))
        try:
            train(engine, 3, batch_fn=hf_batch)
            if name == "mixed":
                stats = engine.activations.stats
                assert stats.bytes_to_ssd > 0 and stats.bytes_swapped_out > 0
            states.append(engine.state_dict())
        finally:
            engine.close()
    assert_state_equal(states[1], states[0])


class FusedQKVBlock(nn.Module):
    """One projection split into q, k, v: three saved views of one storage with the same shape
    and stride and different offsets (the case a key without the offset gets wrong)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + (q * k) * v  # saves q and k (for q*k), then v and q*k


class ToyLM(nn.Module):
    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.layers = nn.ModuleList(FusedQKVBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 256, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def toy_state(tmp_path: Path, modes: list[str]) -> tuple[dict[str, torch.Tensor], Any]:
    torch.manual_seed(0)
    engine = runtime.initialize(ToyLM(), config=job(tmp_path, modes))
    try:
        train(engine, 3)
        return engine.state_dict(), engine.activations.stats
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["swap", "ssd"])
def test_views_of_one_storage_travel_once_and_return_at_their_offsets(tmp_path: Path, mode: str) -> None:
    kept, _ = toy_state(tmp_path / "keep", ["keep", "keep"])
    moved, stats = toy_state(tmp_path / mode, [mode, mode])
    assert_state_equal(moved, kept)
    # Per block and step: q, k and v share the projection's storage, saved three times
    # (q and k by q*k, v by the second product) and sent once.
    assert stats.dedup_hits >= 2 * 2 * 3
    moved_bytes = stats.bytes_swapped_out if mode == "swap" else stats.bytes_to_ssd
    qkv_bytes = 2 * 32 * 3 * 64 * 4
    assert moved_bytes <= 3 * 2 * (qkv_bytes + 3 * 2 * 32 * 64 * 4), "no storage was sent twice"


class InPlaceAfterSave(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)  # saves its output y
        out = y * self.weight
        y.mul_(2)  # changes what tanh saved: autograd must refuse
        return out


class InPlaceLM(ToyLM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(InPlaceAfterSave(64) for _ in range(2))


@pytest.mark.parametrize("mode", ["keep", "swap", "ssd"])
def test_saved_tensor_changed_in_place_raises_like_autograd(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    # Chunk knobs set: with auto ones the first batch would be profiled in plain PyTorch,
    # whose own in-place error would come first.
    config = job(tmp_path, [mode, mode], chunk_size="256KiB", n_persist=0, n_buffer=2)
    engine = runtime.initialize(InPlaceLM(), config=config)
    try:
        data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
        out = engine(**data.batch(0, 0, 0))
        error = SavedTensorModifiedError if mode != "keep" else RuntimeError
        with pytest.raises(error, match="modified by an inplace operation"):
            engine.backward(out)
    finally:
        engine.close()


def test_activation_files_are_written_read_and_removed(tmp_path: Path) -> None:
    engine = runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=job(tmp_path, ["ssd"] * 4))
    store = engine.activations.store
    run_dir = store.run_dir
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    out = engine(**data.batch(0, 0, 0))
    assert any(run_dir.iterdir()), "forward wrote activation files"
    engine.backward(out.loss)
    engine.step()
    assert not any(run_dir.iterdir()), "backward read and deleted every file"
    assert store.stats.bytes_written > 0
    assert engine.activations.stats.bytes_from_ssd + engine.activations.stats.forwarded > 0
    engine.close()
    assert not run_dir.exists()


def test_ssd_blocks_need_a_path(tmp_path: Path) -> None:
    config = job(tmp_path, ["ssd", "keep", "keep", "keep"])
    del config["memory"]["ssd"]
    with pytest.raises(SpecError, match="ssd.path"):
        runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=config)


def test_model_with_its_own_gradient_checkpointing_is_refused(tmp_path: Path) -> None:
    model = tiny_hf("gpt2")
    model.gradient_checkpointing_enable()
    with pytest.raises(SpecError, match="gradient_checkpointing_disable"):
        runtime.initialize(model, config=job(tmp_path, None))


def test_compiled_model_is_refused(tmp_path: Path) -> None:
    model = torch.compile(tiny_gpt())
    with pytest.raises(SpecError, match="uncompiled"):
        runtime.initialize(model, config=job(tmp_path, None))


def test_encoder_decoder_blocks_are_both_lists_in_forward_order() -> None:
    transformers = pytest.importorskip("transformers")
    from protrain.runtime.blocks import find_blocks

    model = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=2
        )
    )
    path, blocks = find_blocks(model, None)
    assert path == "encoder.block,decoder.block"
    assert blocks == [*model.encoder.block, *model.decoder.block]


def test_planner_predicts_hand_set_modes_from_the_profile_and_the_disk(tmp_path: Path) -> None:
    """With an example batch the search profiles the model, measures the disk under ssd.path and
    predicts the hand-set modes: less device memory than keeping everything, the ssd blocks'
    bytes on disk (what the free-space check expects), the disk's rates in the plan's numbers."""
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    batch = data.batch(0, 0, 0)
    plans = {}
    for name, modes in (("keep", ["keep"] * 4), ("moved", ["ssd", "ssd", "swap", "checkpoint"])):
        # Every chunk offloaded at one chunk size: left auto, the search may spend what the moved
        # blocks free on keeping a chunk on the device (n_buffer stays the search's).
        config = job(tmp_path / name, modes, chunk_size=327680, n_persist=0)
        config["profiler"] = {"cache_dir": str(tmp_path / "cache")}
        engine = runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=config, example_batch=batch)
        try:
            plans[name] = engine.plan
            if name == "moved":
                train(engine, 1)
                stats = engine.activations.stats
                # The prediction is the profile's bytes of the two ssd blocks; the run's own
                # dedup finds the same storages (within the kept-small and parameter rules).
                assert engine.plan.predicted_ssd_bytes is not None
                assert 0.5 <= stats.bytes_to_ssd / engine.plan.predicted_ssd_bytes <= 1.5
        finally:
            engine.close()
    keep, moved = plans["keep"], plans["moved"]
    assert keep.predicted_ssd_bytes is None
    def beside_buffers(plan: Any) -> int:  # the peak's activations and transient part
        return plan.predicted_peak_device_bytes - plan.n_buffer * plan.chunk_size

    assert beside_buffers(moved) < beside_buffers(keep)
    assert moved.predicted_step_s > keep.predicted_step_s  # recomputation at least


def test_an_ssd_path_that_cannot_be_written_is_refused_by_name(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = job(tmp_path, ["ssd", "keep", "keep", "keep"])
    config["memory"]["ssd"]["path"] = str(blocker / "ssd")
    config["profiler"] = {"cache_dir": str(tmp_path / "cache")}
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)
    with pytest.raises(SpecError, match=r"memory\.ssd\.path: .*a-file"):
        runtime.initialize(tiny_gpt(config=FOUR_BLOCKS), config=config, example_batch=batch)


@pytest.mark.parametrize("mode", ["swap", "ssd"])
def test_offloaded_bytes_in_flight_stay_within_the_plans_peak_however_slow_the_copies(
    tmp_path: Path, chaos: Any, mode: str
) -> None:
    """The side stream and the disk may fall behind compute (a busy machine, a slow link). Under
    lazy stream chaos no swap copy runs until something waits for it; ssd writes run on the disk
    thread at the disk's pace. Forward waits at each offloaded block's end for the blocks before
    it, so the device holds at most two blocks' bytes in flight, as the plan counts: the measured
    peak (the device wall's count of every storage on the device) stays within the plan's
    predicted peak and its 5% margin. Before, every swapped block stayed on the device until
    backward (3.6 MB held against a plan of 1.3 MB)."""
    if mode == "swap":
        chaos("lazy")
    config = GPTConfig(vocab_size=256, seq_len=32, n_layer=12, n_head=2, d_model=64)
    engine = runtime.initialize(
        tiny_gpt(config=config),
        config=job(tmp_path, [mode] * config.n_layer, n_persist=0, n_buffer=2),
        example_batch=lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0),
    )
    try:
        wall = engine._wall
        assert wall is not None, "the suite runs under the device wall (tests/conftest.py)"
        predicted = engine.plan.predicted_peak_device_bytes
        assert predicted is not None
        data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
        measured = 0
        for update in range(3):
            out = engine(**data.batch(update, 0, 0))
            engine.backward(out if isinstance(out, torch.Tensor) else out.loss)
            measured = max(measured, wall.highest)  # the step's plan check restarts the count
            engine.step()
        assert measured <= predicted * 1.05, (
            f"the device held {measured:,} bytes in a step, over the plan's {predicted:,} (+5%)"
        )
    finally:
        engine.close()

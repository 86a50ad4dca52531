"""Saves never gather the model on the device (issue: a 7B model on 24 GiB needed 27 GiB to save).
Under the device wall, with a device budget of a quarter of the model's fp32 size, a run trains,
evaluates, checkpoints, resumes, returns its state dict and exports (safetensors shards with an
index, a Hugging Face directory, a PEFT adapter) without passing the budget; what it writes
loads back exactly, through ``from_pretrained`` for a tied Hugging Face model; an adapter
export reads only the chunks that hold adapter parameters."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.runtime.chunks.readout import ChunkReadout
from protrain.runtime.model_io import load_safetensors_export
from protrain_demo.gpt import GPT
from tests.helpers import TINY_GPT, TINY_LLAMA, assert_matches_reference, assert_state_equal, gpt_reference, lm_batches

transformers = pytest.importorskip("transformers")

DEEP = dataclasses.replace(TINY_GPT, n_layer=32, d_model=96, n_head=4)
"""3.6M parameters (13.8 MiB in fp32) in many small ones: a quarter of it (3.4 MiB) is above the
smallest plan (every chunk offloaded through buffers of a block's largest weight, every block
recomputed or swapped)."""
UPDATES = 2


@pytest.fixture
def strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROTRAIN_STRICT_DEVICE", "1")


def fp32_bytes(model: torch.nn.Module) -> int:
    return 4 * sum(p.numel() for p in model.parameters())


def job(tmp_path: Path, budget: int, **extra: Any) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"device_budget": budget},
        "profiler": {"cache_dir": str(tmp_path / "cache")},
        "output_dir": str(tmp_path / "runs"),
        **extra,
    }


def deep_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(DEEP)


def test_a_model_four_times_the_budget_trains_saves_resumes_exports_and_evaluates(tmp_path: Path, strict: None) -> None:
    model = deep_gpt()
    budget = fp32_bytes(model) // 4
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    reference = gpt_reference(DEEP, steps=UPDATES, lr=1e-3, weight_decay=0.1)
    config = job(tmp_path, budget, checkpoint={"dir": str(tmp_path / "ckpt")})
    with runtime.initialize(model, config=config, example_batch=data.batch(0, 0, 0)) as engine:
        assert engine.plan.n_persist < engine.plan.num_chunks and engine.plan.predicted_peak_device_bytes <= budget
        for update in range(UPDATES):
            out = engine(**data.batch(update, 0, 0))
            engine.backward(out.loss)
            engine.step()
        engine.eval()
        with torch.no_grad():
            logits = engine(**data.batch(5, 0, 0)).logits
        engine.train()
        saved = engine.save_checkpoint()
        state = engine.state_dict()
        assert all(tensor.device.type == "cpu" for tensor in state.values())
        engine.load_checkpoint(saved)
        engine.export(tmp_path / "model.safetensors", max_shard_size="1MB")
        assert engine._wall is not None and engine._wall.budget == budget  # every call above ran under it
    assert_matches_reference({k: v for k, v in state.items() if k in reference.fp32}, reference.fp32, reference.fp64)
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("model"))
    shards = [name for name in files if name.endswith(".safetensors")]
    assert len(shards) > 4 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards) and index["metadata"]["protrain.tied"]
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for k, v in state.items() if k != "lm_head.weight")
    assert_state_equal(load_safetensors_export(tmp_path / "model.safetensors"), state)
    plain = deep_gpt(1)
    plain.load_state_dict(load_safetensors_export(tmp_path / "model.safetensors"))
    plain.eval()
    with torch.no_grad():
        assert torch.allclose(plain(**data.batch(5, 0, 0)).logits, logits, rtol=1e-5, atol=1e-6)


def test_a_larger_model_than_the_budget_still_returns_its_state_dict_chunk_by_chunk(tmp_path: Path, strict: None) -> None:
    """state_dict() gathered every parameter on the device (the wall stopped it at the first
    chunks past the budget); now the device holds one chunk more at most."""
    model = deep_gpt()
    budget = fp32_bytes(model) // 4
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with runtime.initialize(model, config=job(tmp_path, budget), example_batch=data.batch(0, 0, 0)) as engine:
        wall = engine._wall
        assert wall is not None
        before = wall.live_bytes
        wall.take_highest()
        state = engine.state_dict()
        rise = wall.take_highest() - before
        assert rise <= engine.chunks.layout.chunk_numel * 4, f"the device rose {rise} bytes to save"
    assert sum(v.numel() for v in state.values()) > 4 * budget // 4


def deep_lora() -> torch.nn.Module:
    """LoRA (query and value) over a 16-layer Llama of width 128: 2.5M parameters (9.4 MiB in
    fp32), none above 128 KiB, so a quarter of its fp32 size holds the smallest plan."""
    import peft

    torch.manual_seed(0)
    config = {**TINY_LLAMA, "num_hidden_layers": 16, "hidden_size": 128, "intermediate_size": 256}
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


def tiny_llama(seed: int, *, tied: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tied))


@pytest.mark.parametrize("tied", [True, False])
def test_a_sharded_hf_export_loads_with_from_pretrained_ties_and_all(tmp_path: Path, strict: None, tied: bool) -> None:
    source = tiny_llama(0, tied=tied)
    expected = {name: p.detach().clone() for name, p in source.named_parameters(remove_duplicate=False)}
    budget = fp32_bytes(source) // 2
    memory = {"device_budget": budget, "chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2}
    with runtime.initialize(source, config={**job(tmp_path, budget), "memory": memory}) as engine:
        engine.export(tmp_path / "hf", hf=True, max_shard_size="100KB")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert len([name for name in files if name.startswith("model-")]) > 2
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in weight_map) is not tied
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied
    assert_state_equal({n: p.detach() for n, p in loaded.named_parameters(remove_duplicate=False)}, expected)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_adapter_export_reads_only_the_chunks_holding_adapters(
    tmp_path: Path, strict: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quarter of the LoRA model's fp32 size: it trains an update, and its adapter export reads
    the adapter chunks alone (the frozen base is not gathered) and loads with PEFT."""
    import peft

    read: list[int] = []
    chunks = ChunkReadout.chunks

    def counted(self: ChunkReadout, indices: Any = None) -> Any:
        for info, values in chunks(self, indices):
            read.append(info.index)
            yield info, values

    monkeypatch.setattr(ChunkReadout, "chunks", counted)
    model = deep_lora()
    budget = fp32_bytes(model) // 4
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    with runtime.initialize(model, config=job(tmp_path, budget), example_batch=data.batch(0, 0, 0)) as engine:
        out = engine(**data.batch(0, 0, 0))
        engine.backward(out.loss)
        engine.step()
        trained = {n: p for n, p in engine.state_dict().items() if "lora_" in n}
        read.clear()
        holding = {engine.chunks.store.chunk_of(p) for p in model.parameters() if p.requires_grad}
        engine.export(tmp_path / "adapter", adapter_only=True)
    assert sorted(read) == sorted(holding) and len(holding) < engine.plan.num_chunks
    fresh = peft.PeftModel.from_pretrained(deep_lora().get_base_model(), tmp_path / "adapter")
    loaded = {n: p.detach() for n, p in fresh.named_parameters() if "lora_" in n}
    assert_state_equal(loaded, trained)

"""Exported weights load without ProTrain: one safetensors file (tied weights stored once, the
aliases in its metadata) and a Hugging Face directory, from plain models and from an engine whose
live parameters are placeholders; writes are atomic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from protrain import runtime
from protrain.runtime.model_io import safetensors_stream
from protrain.runtime.chunks.released import ReleasedParameterError
from protrain.runtime.model_io import TIED_METADATA_KEY, export_hf, export_safetensors, load_safetensors_export
from protrain_demo.gpt import GPT, PRESETS
from tests.helpers import TINY_LLAMA, assert_state_equal

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(60)


def tiny_gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(PRESETS["tiny"])


def tiny_llama(seed: int, *, tied: bool) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tied))


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def stored_names(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as handle:
        return set(handle.keys())


def file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata() or {}


def restore_aliases(path: Path) -> dict[str, torch.Tensor]:
    """What a user without ProTrain does: plain load_file, then the aliases from the metadata."""
    values = safetensors.torch.load_file(str(path))
    for alias, canonical in json.loads(file_metadata(path).get(TIED_METADATA_KEY, "{}")).items():
        values[alias] = values[canonical]
    return values


def is_placeholder(param: torch.Tensor) -> bool:
    return param.untyped_storage().nbytes() < param.numel() * param.element_size()


def offloaded_engine(model: nn.Module, tmp_path: Path) -> Any:
    """An engine on CPU with every chunk offloaded: the live parameters are placeholders."""
    config = {
        "seed": 3,
        "micro_batch_size": 2,
        "memory": {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2},
        "output_dir": str(tmp_path / "runs"),
    }
    return runtime.initialize(model, config=config)


# ------------------------------------------------------------------------------ export_safetensors


@pytest.mark.parametrize("kind", ["gpt", "llama-tied", "llama-untied"])
@pytest.mark.parametrize("with_model", [True, False])
def test_safetensors_round_trip_is_bit_exact_and_stores_ties_once(
    tmp_path: Path, kind: str, with_model: bool
) -> None:
    build = {
        "gpt": lambda seed: tiny_gpt(seed),
        "llama-tied": lambda seed: tiny_llama(seed, tied=True),
        "llama-untied": lambda seed: tiny_llama(seed, tied=False),
    }[kind]
    source = build(0)
    expected = state_of(source)
    # Ties decided from the model, or (without it) from the shared tensors of its state dict.
    state = expected if with_model else source.state_dict()
    path = tmp_path / "model.safetensors"
    dropped = export_safetensors(state, path, model=source if with_model else None)

    alias, canonical = ("lm_head.weight", "wte.weight" if kind == "gpt" else "model.embed_tokens.weight")
    if kind == "llama-untied":
        assert dropped == []
        assert TIED_METADATA_KEY not in file_metadata(path)
        assert stored_names(path) == set(expected)
    else:
        assert dropped == [alias]
        assert json.loads(file_metadata(path)[TIED_METADATA_KEY]) == {alias: canonical}
        assert stored_names(path) == set(expected) - {alias}
    for values in (restore_aliases(path), load_safetensors_export(path)):
        fresh = build(1)
        fresh.load_state_dict(values, strict=True)
        assert_state_equal(state_of(fresh), expected)


def test_plain_load_with_strict_false_fills_the_alias_through_the_models_tie(tmp_path: Path) -> None:
    source = tiny_gpt(0)
    path = tmp_path / "gpt.safetensors"
    export_safetensors(source.state_dict(), path, model=source)
    fresh = tiny_gpt(1)
    result = fresh.load_state_dict(safetensors.torch.load_file(str(path)), strict=False)
    assert result.missing_keys == ["lm_head.weight"] and result.unexpected_keys == []
    assert_state_equal(state_of(fresh), state_of(source))


def test_export_of_an_offloaded_engine_loads_into_a_plain_model(tmp_path: Path) -> None:
    engine = offloaded_engine(tiny_gpt(0), tmp_path)
    with engine:
        assert is_placeholder(engine.module.wte.weight)
        expected = engine.state_dict()
        path = tmp_path / "engine.safetensors"
        dropped = export_safetensors(expected, path, model=engine.module, metadata={"step": "0"})
        # The live model's own state dict is refused where it is read: it holds no values.
        with pytest.raises(ReleasedParameterError, match="^wte.weight was read .*engine.state_dict"):
            export_safetensors(engine.module.state_dict(), tmp_path / "bad.safetensors")
        with pytest.raises(ValueError, match="placeholder"):
            export_safetensors(engine.module.state_dict(keep_vars=True), tmp_path / "bad.safetensors")
    assert dropped == ["lm_head.weight"]
    assert file_metadata(path)["step"] == "0"
    fresh = tiny_gpt(1)
    fresh.load_state_dict(load_safetensors_export(path), strict=True)
    assert_state_equal(state_of(fresh), expected)
    assert fresh.lm_head.weight is fresh.wte.weight


def test_bfloat16_export_casts_floating_tensors(tmp_path: Path) -> None:
    source = tiny_gpt(0)
    path = tmp_path / "bf16.safetensors"
    export_safetensors(source.state_dict(), path, model=source, dtype=torch.bfloat16)
    values = load_safetensors_export(path)
    assert {tensor.dtype for tensor in values.values()} == {torch.bfloat16}
    for name, tensor in source.state_dict().items():
        assert torch.equal(values[name], tensor.to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="not a floating type"):
        export_safetensors(source.state_dict(), path, dtype=torch.int8)


def test_tied_copies_that_differ_are_refused(tmp_path: Path) -> None:
    source = tiny_gpt(0)
    state = state_of(source)
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="tied in the model but differ"):
        export_safetensors(state, tmp_path / "x.safetensors", model=source)


def test_views_sharing_memory_that_are_not_ties_are_stored_apart(tmp_path: Path) -> None:
    flat = torch.arange(12, dtype=torch.float32)
    state = {"a": flat[:6].view(2, 3), "b": flat[6:].view(3, 2), "c": flat[:6].view(2, 3)}
    path = tmp_path / "views.safetensors"
    assert export_safetensors(state, path) == ["c"]
    values = load_safetensors_export(path)
    assert_state_equal(values, {name: tensor.clone() for name, tensor in state.items()})


def fail_after(monkeypatch: pytest.MonkeyPatch, tensors: int, error: str) -> None:
    """The writer fails (a full disk, say) once ``tensors`` tensors are in the file."""
    add = safetensors_stream.ShardedWriter.add
    count = [0]

    def failing(self: safetensors_stream.ShardedWriter, name: str, tensor: torch.Tensor) -> None:
        if count[0] == tensors:
            raise OSError(error)
        count[0] += 1
        add(self, name, tensor)

    monkeypatch.setattr(safetensors_stream.ShardedWriter, "add", failing)


def test_failed_write_leaves_neither_the_file_nor_a_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_after(monkeypatch, 3, "disk full")
    source = tiny_gpt(0)
    with pytest.raises(OSError, match="disk full"):
        export_safetensors(source.state_dict(), tmp_path / "model.safetensors", model=source)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tiny_gpt(0)
    path = tmp_path / "model.safetensors"
    export_safetensors(source.state_dict(), path, model=source)
    before = path.read_bytes()
    fail_after(monkeypatch, 3, "boom")
    with pytest.raises(OSError, match="boom"):
        export_safetensors(source.state_dict(), path, model=source, dtype=torch.bfloat16)
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]


def test_reserved_metadata_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        export_safetensors(
            {"w": torch.ones(2)}, tmp_path / "x.safetensors", metadata={TIED_METADATA_KEY: "{}"}
        )


# ------------------------------------------------------------------------------------- export_hf


def hf_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("tied", [True, False])
def test_hf_directory_round_trip_through_an_offloaded_engine(tmp_path: Path, tied: bool) -> None:
    reference = hf_parameters(tiny_llama(0, tied=tied))
    engine = offloaded_engine(tiny_llama(0, tied=tied), tmp_path)
    with engine:
        assert is_placeholder(engine.module.model.embed_tokens.weight)
        state = engine.state_dict()
        directory = export_hf(engine.module, state, tmp_path / "hf")
        assert engine.module.config.architectures is None  # the live config is left as it was
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert ("lm_head.weight" in stored_names(directory / "model.safetensors")) is not tied
    loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
    assert_state_equal(hf_parameters(loaded), reference)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_hf_bfloat16_export_records_the_dtype(tmp_path: Path) -> None:
    source = tiny_llama(0, tied=True)
    directory = export_hf(source, state_of(source), tmp_path / "hf", dtype=torch.bfloat16)
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.model.embed_tokens.weight, source.model.embed_tokens.weight.to(torch.bfloat16))


def test_hf_refuses_a_non_empty_directory_unless_overwrite(tmp_path: Path) -> None:
    first, second = tiny_llama(0, tied=False), tiny_llama(1, tied=False)
    directory = tmp_path / "hf"
    export_hf(first, state_of(first), directory)
    with pytest.raises(ValueError, match="overwrite=True"):
        export_hf(second, state_of(second), directory)
    export_hf(second, state_of(second), directory, overwrite=True)
    loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
    assert_state_equal(hf_parameters(loaded), hf_parameters(second))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_hf_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tiny_llama(0, tied=True)
    fail_after(monkeypatch, 3, "disk full")
    with pytest.raises(OSError, match="disk full"):
        export_hf(source, state_of(source), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_hf_export_of_a_non_hf_model_is_a_type_error(tmp_path: Path) -> None:
    model = tiny_gpt(0)
    with pytest.raises(TypeError, match="got GPT; use export_safetensors"):
        export_hf(model, model.state_dict(), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []

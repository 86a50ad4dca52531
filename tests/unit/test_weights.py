"""initialize(..., weights=...) from a state dict, safetensors shards or a callable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from protrain import runtime
from tests.helpers import TINY_LLAMA, assert_state_equal, lm_batches, tiny_gpt


def config(tmp_path: Path) -> dict[str, object]:
    return {"output_dir": str(tmp_path / "runs")}


def test_state_dict_and_callable(tmp_path: Path) -> None:
    source = tiny_gpt(seed=11).state_dict()
    engine = runtime.initialize(tiny_gpt(seed=0), config=config(tmp_path), weights=source)
    assert_state_equal(engine.state_dict(), source)
    engine.close()
    engine = runtime.initialize(
        tiny_gpt(seed=0), config=config(tmp_path), weights=lambda name, t: source[name]
    )
    assert_state_equal(engine.state_dict(), source)
    engine.close()


def test_safetensors_shards_with_tied_weight_saved_once(tmp_path: Path) -> None:
    source = tiny_gpt(seed=12).state_dict()
    tensors = {k: v.clone() for k, v in source.items() if k != "lm_head.weight"}  # tied: stored once
    names = sorted(tensors)
    half = len(names) // 2
    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({k: tensors[k] for k in names[:half]}, str(shards / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(shards / "model-00002-of-00002.safetensors"))
    engine = runtime.initialize(tiny_gpt(seed=0), config=config(tmp_path), weights=shards)
    assert_state_equal(engine.state_dict(), source)
    assert engine.module.lm_head.weight is engine.module.wte.weight
    engine.close()


def test_missing_and_misshapen_weights_are_named(tmp_path: Path) -> None:
    source = tiny_gpt(seed=12).state_dict()
    partial = {k: v for k, v in source.items() if not k.startswith("ln_f")}
    with pytest.raises(ValueError, match="missing.*ln_f"):
        runtime.initialize(tiny_gpt(), config=config(tmp_path), weights=partial)
    bad = dict(source, **{"ln_f.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"ln_f.weight has shape \(3,\)"):
        runtime.initialize(tiny_gpt(), config=config(tmp_path), weights=bad)
    with pytest.raises(ValueError, match="no .safetensors files"):
        runtime.initialize(tiny_gpt(), config=config(tmp_path), weights=tmp_path)


def test_meta_model_is_materialised_from_weights_keeping_real_buffers(tmp_path: Path) -> None:
    from accelerate import init_empty_weights

    source = tiny_gpt(seed=13)
    with init_empty_weights():
        empty = tiny_gpt(seed=0)
    empty.register_buffer("scale", torch.tensor([2.5]))  # a real buffer, not in the weights
    assert empty.wte.weight.is_meta
    engine = runtime.initialize(empty, config=config(tmp_path), weights=source.state_dict())
    state = engine.state_dict()
    assert_state_equal({k: v for k, v in state.items() if k != "scale"}, source.state_dict())
    assert torch.equal(state["scale"], torch.tensor([2.5]))
    engine.close()


def test_meta_model_without_weights_is_refused(tmp_path: Path) -> None:
    from accelerate import init_empty_weights

    with init_empty_weights():
        empty = tiny_gpt()
    with pytest.raises(ValueError, match="meta device and no weights were given"):
        runtime.initialize(empty, config=config(tmp_path))


def test_hf_model_larger_than_the_pool_from_save_pretrained_shards(tmp_path: Path) -> None:
    """Fine-tuning start: pretrained weights written by save_pretrained (several shards), the
    model built empty, its chunks loaded into a device pool far smaller than the model."""
    transformers = pytest.importorskip("transformers")
    from accelerate import init_empty_weights

    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    torch.manual_seed(21)
    pretrained = transformers.GPT2LMHeadModel(config)
    pretrained.save_pretrained(tmp_path / "pretrained", max_shard_size="100KB")
    assert len(list((tmp_path / "pretrained").glob("*.safetensors"))) > 1
    with init_empty_weights():
        empty = transformers.GPT2LMHeadModel(config)
    spec = {
        "output_dir": str(tmp_path / "runs"),
        "memory": {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2},
    }
    engine = runtime.initialize(empty, config=spec, weights=tmp_path / "pretrained")
    pool_bytes = sum(slot.numel() * slot.element_size() for slot in engine.chunks.slots)
    model_bytes = sum(p.numel() * 4 for p in pretrained.parameters())
    assert pool_bytes < model_bytes / 3
    expected = pretrained.state_dict()
    state = engine.state_dict()
    assert_state_equal({k: state[k] for k in expected}, dict(expected))
    engine.close()


def test_a_meta_model_is_streamed_one_parameter_at_a_time(tmp_path: Path) -> None:
    """The full model never exists: each value the source hands out is dropped once it is in
    its chunk, so at most one is alive at any moment (counted by the values' own finalizers,
    not by the runtime)."""
    import weakref

    from accelerate import init_empty_weights

    source = tiny_gpt(seed=13).state_dict()
    alive = [0]
    most_alive = [0]
    handed_out: list[str] = []

    def read(name: str, empty: torch.Tensor) -> torch.Tensor:
        assert empty.is_meta, "the model itself must not have been materialised"
        value = source[name].clone()
        handed_out.append(name)
        alive[0] += 1
        most_alive[0] = max(most_alive[0], alive[0])
        weakref.finalize(value, lambda: alive.__setitem__(0, alive[0] - 1))
        return value

    with init_empty_weights():
        empty = tiny_gpt(seed=0)
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)
    spec = {**config(tmp_path), "memory": {"chunk_size": "64KiB", "n_persist": 0}}
    engine = runtime.initialize(empty, config=spec, weights=read, example_batch=batch)
    assert most_alive[0] == 1 and alive[0] == 0
    # Each unique parameter read once (the tied head is the embedding, read under one name).
    assert len(handed_out) == len(set(handed_out)) == len({id(p) for p in engine.module.parameters()})
    assert not any(p.is_meta for p in engine.module.parameters())
    assert_state_equal({k: v for k, v in engine.state_dict().items() if k in source}, source)
    out = engine(**batch)  # trains from the streamed weights
    engine.backward(out.loss)
    engine.step()
    engine.close()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_model_init_gives_each_parameter_its_constructors_init(arch: str) -> None:
    """ModelInit, the weights source for a model too large to build whole: norms and biases get
    exactly the constructor's constants, weights its N(0, 0.02); the same value however often or
    in whatever order it is asked (every rank fills its chunks alike), whatever the global
    random state, and one source per seed."""
    from accelerate import init_empty_weights

    from protrain.runtime.model_io.weights import ModelInit

    if arch == "gpt":
        torch.manual_seed(0)
        whole = tiny_gpt(seed=0)
        with init_empty_weights():
            empty = tiny_gpt(seed=0)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        whole = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
        with init_empty_weights():
            empty = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    init = ModelInit(empty, seed=7)
    names = [name for name, _ in empty.named_parameters()]
    first = {name: init(name, empty.get_parameter(name)) for name in names}
    torch.manual_seed(123)  # the global stream does not matter, nor the order
    again = {name: init(name, empty.get_parameter(name)) for name in reversed(names)}
    other_seed = ModelInit(empty, seed=8)
    for name, expected in whole.named_parameters():
        value = first[name]
        assert torch.equal(value, again[name]), name
        assert value.shape == expected.shape and value.dtype == expected.dtype
        if bool((expected == expected.flatten()[0]).all()):  # a constant: ones or zeros
            assert torch.equal(value, expected), name
        else:
            assert abs(value.std().item() - 0.02) < 0.004 and abs(value.mean().item()) < 0.004, name
            assert not torch.equal(value, other_seed(name, empty.get_parameter(name))), name
    assert all(p.is_meta for p in empty.parameters()), "the model itself is never materialised"


def test_model_init_refuses_a_parameter_nothing_initialises() -> None:
    from accelerate import init_empty_weights

    from protrain.runtime.model_io.weights import ModelInit

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))  # set in __init__, by no initialiser

    with init_empty_weights():
        model = Scaled()
    with pytest.raises(ValueError, match="sets scale; pass the weights instead"):
        ModelInit(model, seed=0)("scale", model.scale)

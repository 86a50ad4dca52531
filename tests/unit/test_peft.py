"""LoRA through the engine, as a PEFT user meets it: a ``peft`` model (LoRA on a frozen base,
``modules_to_save`` included) trains like plain PyTorch + PEFT under offloaded chunks and
recomputed and swapped blocks; the base sits in frozen chunks (no gradient, no optimizer state)
and comes out unchanged and with its shapes; ``engine.export(adapter_only=True)`` writes what
``PeftModel.from_pretrained`` loads, with the same outputs; a bf16 base under fp32 adapters
stays bf16; the plan output says what the frozen base saves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from protrain import runtime  # noqa: E402
from tests.helpers import TINY_LLAMA, assert_matches_reference, assert_state_equal, lm_batches  # noqa: E402

# PEFT 0.21 itself reads transformers' deprecated is_gradient_checkpointing when wrapping a model.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
STEPS = 5
LR = 1e-3
BF16_LOSS_RTOL = 2e-2
"""As tests/unit/test_mixed_precision.py: bf16 compute follows fp32 to 2% per step."""


def lora_llama(seed: int = 0, *, base_dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).to(base_dtype)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, modules_to_save=["lm_head"]
    )
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(base, config)


def job(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": LR, "weight_decay": 0.0},
        # Offloaded chunks (frozen ones among them) through two buffers, one block recomputed and
        # one swapped: where DeepSpeed lost frozen parameters (DeepSpeed#4332).
        "memory": {
            "chunk_size": "64KiB",
            "n_persist": 1,
            "n_buffer": 3,
            "block_modes": ["checkpoint", "swap"],
        },
        "output_dir": str(tmp_path / "runs"),
        **extra,
    }


def train_plain(
    model: nn.Module, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch + PEFT: torch's AdamW over the trainable parameters, the spec's betas."""
    model = model.to(dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=LR, weight_decay=0.0, betas=(0.9, 0.95), fused=dtype == torch.float32
    )
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    losses = []
    for step in range(STEPS):
        loss = model(**data.batch(step, 0, 0)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train_engine(engine: Any) -> list[float]:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    losses = []
    for step in range(STEPS):
        out = engine(**data.batch(step, 0, 0))
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses


@pytest.fixture(scope="module")
def plain() -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor]]:
    fp32, losses = train_plain(lora_llama())
    fp64, _ = train_plain(lora_llama(), torch.float64)
    return fp32, losses, fp64


def test_lora_trains_like_plain_peft_and_the_base_stays_frozen(tmp_path: Path, plain: Any) -> None:
    fp32, losses, fp64 = plain
    model = lora_llama()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = runtime.initialize(model, config=job(tmp_path))
    with engine:
        assert [m.value for m in engine.plan.block_modes] == ["checkpoint", "swap"]
        frozen = [c for c in engine.chunks.chunks if not c.info.trainable]
        trainable = [c for c in engine.chunks.chunks if c.info.trainable]
        assert frozen and trainable and any(not c.persistent for c in frozen)
        assert all(c.training is None for c in frozen)  # no gradient shard, no Adam state
        names = {info.name: info.trainable for info in engine.chunks.layout.params}
        assert all(".base_layer." not in n and "embed_tokens" not in n for n, t in names.items() if t)
        got_losses = train_engine(engine)
        state = engine.state_dict()
    assert got_losses == pytest.approx(losses, rel=1e-5)
    assert_matches_reference(state, fp32, fp64)
    base = {k: v for k, v in initial.items() if "lora_" not in k and "modules_to_save" not in k}
    assert_state_equal({k: state[k] for k in base}, base)  # shapes and values, bit for bit
    trained = [k for k in state if "lora_B" in k]
    assert trained and all(not torch.equal(state[k], initial[k]) for k in trained)


def test_recomputed_blocks_read_their_frozen_weights_after_the_buffers_moved_on(tmp_path: Path, plain: Any) -> None:
    """Every block recomputed, every chunk offloaded through two small buffers: a recomputed
    block's frozen base weights (layer norms, projections) come from buffers that later chunks
    take over before that block's backward is done. checkpoint keeps a frozen parameter itself,
    not a copy of its data, so it must still hold the recomputation's values then (it held the
    NaN placeholder, and every adapter gradient was NaN)."""
    fp32, losses, fp64 = plain
    memory = {"chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2, "block_modes": ["checkpoint", "checkpoint"]}
    with runtime.initialize(lora_llama(), config=job(tmp_path, memory=memory)) as engine:
        frozen = [c for c in engine.chunks.chunks if not c.info.trainable]
        assert len(frozen) > 2 and engine.chunks.n_buffer == 2
        got_losses = train_engine(engine)
        state = engine.state_dict()
    assert got_losses == pytest.approx(losses, rel=1e-5)
    assert_matches_reference(state, fp32, fp64)


def test_adapter_export_loads_with_peft_and_gives_the_same_logits(tmp_path: Path) -> None:
    engine = runtime.initialize(lora_llama(), config=job(tmp_path))
    with engine:
        train_engine(engine)
        state = engine.state_dict()
        target = engine.export(tmp_path / "adapter", adapter_only=True)
    files = sorted(p.name for p in target.iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((target / "adapter_config.json").read_text())["r"] == 4
    saved = peft.utils.load_peft_weights(str(target))
    assert saved and all("lora_" in k or "lm_head" in k for k in saved)  # adapters only, no base
    torch.manual_seed(0)
    fresh_base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    loaded = peft.PeftModel.from_pretrained(fresh_base, str(target)).eval()
    reference = lora_llama()
    reference.load_state_dict(state)
    tokens = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(99, 0, 0)["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, reference.eval()(input_ids=tokens).logits)


def test_a_bf16_base_under_fp32_adapters_stays_bf16_and_tracks_plain_peft(tmp_path: Path) -> None:
    model = lora_llama(base_dtype=torch.bfloat16)
    for module in model.modules():  # PEFT's own rule: adapters fp32 over a half-precision base
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.lora_A.float()
            module.lora_B.float()
    model.base_model.model.lm_head.modules_to_save.float()
    dtypes = {(p.dtype, p.requires_grad) for p in model.parameters()}
    assert dtypes == {(torch.bfloat16, False), (torch.float32, True)}
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = runtime.initialize(model, config=job(tmp_path, precision="bf16"))
    with engine:
        losses = train_engine(engine)
        state = engine.state_dict()
    base_names = [k for k in state if "lora_" not in k and "modules_to_save" not in k]
    assert all(state[k].dtype == torch.bfloat16 for k in base_names)  # no fp32 copy of the base
    assert_state_equal({k: state[k] for k in base_names}, {k: initial[k] for k in base_names})
    assert all(state[k].dtype == torch.float32 for k in state if "lora_" in k)  # fp32 masters
    _, plain_losses = train_plain(lora_llama(base_dtype=torch.bfloat16))
    assert losses == pytest.approx(plain_losses, rel=BF16_LOSS_RTOL)


def test_the_plan_output_says_what_the_frozen_base_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with runtime.initialize(lora_llama(), config=job(tmp_path)):
        pass
    out = " ".join(capsys.readouterr().out.split())
    assert "frozen: " in out and "in frozen chunks, with no gradient or optimizer state" in out


def test_adapter_only_export_of_a_model_without_adapters_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain_llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    with runtime.initialize(plain_llama, config=job(tmp_path)) as engine:
        with pytest.raises(TypeError, match="needs a peft.PeftModel, got LlamaForCausalLM"):
            engine.export(tmp_path / "adapter", adapter_only=True)
        with pytest.raises(ValueError, match="exclude each other"):
            engine.export(tmp_path / "both", hf=True, adapter_only=True)
    assert not (tmp_path / "adapter").exists()


def test_a_persistent_frozen_base_is_stored_once_and_adapter_chunks_hold_no_padding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA base kept on the device takes one copy (7B in bf16: 13.5 GB, not 27 GB): each frozen
    chunk's shard is a view of its full copy. The adapter chunk, mostly empty, carries fp32
    state for its parameters only, not for its padding. The device tier counted by the wall (not
    by the engine's own books) is what the cost model predicts for the layout, plus the engine's
    bookkeeping tensors (step counters, per-parameter flags: bytes)."""
    from protrain.profiler.cost_model import chunk_costs
    from protrain.profiler.profile import ModelProfile
    from tests.unit.test_cost_model import hardware

    monkeypatch.setenv("PROTRAIN_STRICT_DEVICE", "1")
    model = lora_llama()
    config = job(tmp_path, memory={"chunk_size": "64KiB", "device_budget": "256MiB"})
    with runtime.initialize(model, config=config) as engine:
        chunks = engine.chunks
        assert engine.plan.n_persist == engine.plan.num_chunks, "every chunk on the device"
        frozen = [c for c in chunks.chunks if c.training is None]
        adapters = [c for c in chunks.chunks if c.training is not None]
        assert frozen and adapters
        for chunk in frozen:
            assert chunk.master.untyped_storage().data_ptr() == chunk.full.untyped_storage().data_ptr()
        for chunk in adapters:
            state = [chunk.master, chunk.grad_shard, chunk.optimizer.exp_avg, chunk.optimizer.exp_avg_sq]
            assert {t.numel() for t in state} == {chunk.info.used}, "no state for padding"
        assert adapters[0].info.used < chunks.layout.chunk_numel // 4, "the test needs a mostly empty chunk"
        measured = engine._wall.live_bytes
        base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        frozen_bytes = sum(c.full.numel() * c.full.element_size() for c in frozen)
        assert frozen_bytes <= 1.25 * base, "one copy of the base (and its chunks' padding)"
        profile = ModelProfile(
            batch_shape=(2, 32),
            precision="fp32",
            element_size=4,
            param_sizes=tuple((p.numel, p.trainable) for p in chunks.layout.params),
            param_block=(-1,) * len(chunks.layout.params),
            module_params=(),
            blocks=(),
            other_forward_s=1e-3,
            other_backward_s=1e-3,
            other_activation_bytes=0,
            transient_bytes=0,
        )
        costs = chunk_costs(profile, hardware(), engine.plan.chunk_size)
        predicted = costs.persistent_bytes[-1]
        assert predicted == chunks.device_state_bytes()
        assert predicted <= measured <= predicted + 1024, (measured, predicted)

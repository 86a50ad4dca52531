"""initialize with an example batch: the model and machine are profiled and the search fills the
"auto" knobs with the fastest plan that fits; hand-set knobs stay; nothing fitting is a clear
error; profiling leaves the model and the random streams as they were."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.profiler.plan import BlockMode, Plan
from protrain.profiler.profile import ModelProfile
from protrain.runtime.data.batches import call_model, default_loss
from protrain.runtime.blocks import find_blocks
from protrain.runtime.chunks.layout import model_params
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.hw.device import select_device
from protrain.runtime.planning.model_profiling import profile_model
from protrain.runtime.planning.profilers import Profilers
from tests.helpers import assert_state_equal, lm_batches, tiny_gpt, train_reference

KIB = 1024


def job(tmp_path: Path, **memory: Any) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"chunk_size": "64KiB", **memory},
        "profiler": {"cache_dir": str(tmp_path / "cache"), "warmup_steps": 1, "profile_steps": 1},
        "output_dir": str(tmp_path / "runs"),
    }


def example() -> dict[str, torch.Tensor]:
    return lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)


def fp32_profile(
    model: torch.nn.Module,
    run: Any,
    *,
    batch_shape: tuple[int, ...],
    block_path: str = "",
    warmup_steps: int = 1,
    profile_steps: int = 2,
    chunked: Any = None,
    clock: Any = None,
) -> ModelProfile:
    """``profile_model`` in fp32 on this machine's device, blocks found under ``block_path``
    (``clock``: the steps' wall clock, default the real one)."""
    blocks = list(model.get_submodule(block_path)) if block_path else []
    return profile_model(
        model,
        run,
        loss_fn=default_loss,
        params=model_params(model, None),
        blocks=blocks,
        block_path=block_path,
        module_params=[],
        batch_shape=batch_shape,
        precision="fp32",
        element_size=4,
        device=select_device(0),
        warmup_steps=warmup_steps,
        profile_steps=profile_steps,
        chunked=chunked,
        **({} if clock is None else {"clock": clock}),
    )


def test_a_tight_budget_gets_a_searched_plan_that_fits_and_trains_exactly(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    expected, _ = train_reference(tiny_gpt(), data, steps=4, lr=1e-3, weight_decay=0.1)
    budget = 2048 * KIB  # the tiny GPT's resident model state alone needs ~2.4 MiB
    engine = runtime.initialize(
        tiny_gpt(), config=job(tmp_path, device_budget=budget), example_batch=example()
    )
    plan = engine.plan
    assert plan.rule.startswith("search: fastest of") and "plans that fit" in plan.rule
    assert 0 <= plan.n_persist < plan.num_chunks and plan.n_buffer >= 1
    assert plan.predicted_step_s is not None and plan.predicted_step_s > 0
    assert plan.predicted_peak_device_bytes is not None
    assert plan.predicted_peak_device_bytes * 1.05 <= budget
    assert {"memory.n_persist", "memory.n_buffer"} <= set(plan.chosen)
    for update in range(4):
        out = engine(**data.batch(update, 0, 0))
        engine.backward(out.loss)
        engine.step()
    assert_state_equal(engine.state_dict(), expected)
    engine.close()
    assert (tmp_path / "cache").is_dir(), "the hardware profile is cached under profiler.cache_dir"


def big_batch_job(tmp_path: Path, device_budget: int | str) -> dict[str, Any]:
    """Sixteen samples per micro-batch: saved activations dominate the tiny GPT's memory."""
    return {**job(tmp_path, device_budget=device_budget), "micro_batch_size": 16}


def all_kept_plan(tmp_path: Path, batch: dict[str, torch.Tensor]) -> Plan:
    """The plan searched with room for everything (every chunk persistent, every block kept)."""
    engine = runtime.initialize(tiny_gpt(), config=big_batch_job(tmp_path, "1GiB"), example_batch=batch)
    engine.close()
    assert engine.plan.predicted_peak_device_bytes is not None
    return engine.plan


def test_activation_knobs_are_searched_when_activations_bind(tmp_path: Path) -> None:
    """Sixteen samples per micro-batch: saved activations dominate the tiny GPT's memory, so under
    a budget of 65% of the all-kept plan the search recomputes or offloads blocks; the math stays
    plain PyTorch's."""
    data = lm_batches(micro_batch_size=16, accumulation=1, world_size=1)
    kept = all_kept_plan(tmp_path, data.batch(0, 0, 0))
    assert set(kept.block_modes) == {BlockMode.KEEP} and kept.predicted_peak_device_bytes is not None
    budget = int(kept.predicted_peak_device_bytes * 0.65)
    engine = runtime.initialize(
        tiny_gpt(), config=big_batch_job(tmp_path, budget), example_batch=data.batch(0, 0, 0)
    )
    plan = engine.plan
    assert set(plan.block_modes) != {BlockMode.KEEP}
    assert {"memory.n_swap", "memory.n_checkpoint"} <= set(plan.chosen)
    assert plan.predicted_peak_device_bytes is not None and plan.predicted_peak_device_bytes * 1.05 <= budget
    expected, _ = train_reference(tiny_gpt(), data, steps=3, lr=1e-3, weight_decay=0.1)
    for update in range(3):
        out = engine(**data.batch(update, 0, 0))
        engine.backward(out.loss)
        engine.step()
    assert_state_equal(engine.state_dict(), expected)
    engine.close()


def test_hand_set_knobs_are_kept_while_the_rest_is_searched(tmp_path: Path) -> None:
    engine = runtime.initialize(
        tiny_gpt(), config=job(tmp_path, device_budget="64MiB", n_persist=3), example_batch=example()
    )
    assert engine.plan.n_persist == 3 and engine.plan.rule.startswith("search")
    assert "memory.n_persist" not in engine.plan.chosen and "memory.n_buffer" in engine.plan.chosen
    engine.close()


def test_nothing_fitting_is_refused_with_the_shortfall(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        runtime.initialize(tiny_gpt(), config=job(tmp_path, device_budget="600KiB"), example_batch=example())
    text = str(err.value)
    assert text.startswith("memory: no plan fits the device budget of 600.00 KiB per rank")
    assert "more)" in text and "saved activations" in text and "micro_batch_size" in text


def test_knobs_no_plan_can_honour_are_refused_before_profiling_with_what_works(tmp_path: Path) -> None:
    """The activation knobs are left to the search, so this would profile first: the chunk
    knobs are judged before, and the refusal names the smallest value of each that works."""
    config = job(tmp_path, n_persist=0, n_buffer=1)  # 64 KiB chunks
    with pytest.raises(SpecError) as err:
        runtime.initialize(tiny_gpt(), config=config, example_batch=example())
    text = str(err.value)
    assert text.startswith("memory.n_buffer=1 is too few: module 'blocks.0.mlp.fc' uses 2 non-persistent")
    assert "the smallest n_buffer that works is 2" in text
    assert "keeping n_buffer=1, the smallest n_persist that works is 11" in text
    assert "keeping n_persist=0 and n_buffer=1, the smallest chunk_size that works is 80KiB" in text
    assert not (tmp_path / "cache").exists(), "nothing was profiled"
    # The value named works.
    engine = runtime.initialize(tiny_gpt(), config=job(tmp_path, n_persist=0, n_buffer=2))
    assert (engine.plan.n_persist, engine.plan.n_buffer) == (0, 2)
    engine.close()


def test_profile_sees_every_block_and_leaves_the_model_untouched(tmp_path: Path) -> None:
    model = tiny_gpt()
    batch = example()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    path, blocks = find_blocks(model, None)
    params = model_params(model, None)
    rng = torch.get_rng_state()
    profile = fp32_profile(
        model, lambda: call_model(model, batch), batch_shape=tuple(batch["input_ids"].shape), block_path=path
    )
    assert torch.equal(torch.get_rng_state(), rng), "profiling must not move the random stream"
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert len(profile.blocks) == len(blocks) >= 2
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in profile.blocks)
    # Identical blocks save the same bytes; the embedding and head live outside them.
    sizes = {b.activation_bytes for b in profile.blocks}
    assert len(sizes) == 1 and sizes.pop() > 0
    assert profile.other_activation_bytes > 0
    # What a checkpointed block would keep: its input hidden states, batch x seq x width fp32.
    width = model.config.d_model
    assert {b.input_bytes for b in profile.blocks} == {2 * 32 * width * 4}
    owners = dict(zip((p.name for p in params), profile.param_block, strict=True))
    assert owners[f"{path}.0.attn.qkv.weight"] == 0 and owners[f"{path}.1.attn.qkv.weight"] == 1
    assert owners["wte.weight"] == -1
    assert profile.batch_shape == (2, 32)


def test_saved_bytes_count_each_storage_once(tmp_path: Path) -> None:
    """A tensor saved by three operators, and two views of one buffer, are stored once."""

    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.blocks[0](x)  # saves x (input) for the weight gradient
            y = torch.sigmoid(h)  # saves its output y
            a, b = y[:, :4], y[:, 4:]  # views of y
            return (a * b).sum() + (y * y).sum()  # saves a, b, y, y: all storage of y

    model = Shared()
    x = torch.randn(16, 8)
    profile = fp32_profile(
        model, lambda: model(x), batch_shape=(16, 8), block_path="blocks", warmup_steps=0, profile_steps=1
    )
    # Inside the block: x (16x8 fp32). Outside: y once (16x8 fp32), though saved four times.
    assert profile.blocks[0].activation_bytes == 16 * 8 * 4
    assert profile.blocks[0].input_bytes == 16 * 8 * 4
    assert profile.other_activation_bytes == 16 * 8 * 4


def test_measured_step_time_is_set_beside_the_prediction_in_the_metrics(tmp_path: Path) -> None:
    import json

    engine = runtime.initialize(
        tiny_gpt(), config=job(tmp_path, device_budget="64MiB"), example_batch=example()
    )
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    for update in range(6):
        out = engine(**data.batch(update, 0, 0))
        engine.backward(out.loss)
        engine.step()
    engine.close()
    (metrics,) = (tmp_path / "runs").glob("*/metrics.jsonl")
    checks = [json.loads(line) for line in metrics.read_text().splitlines() if "plan_check" in line]
    assert len(checks) == 1, "compared once, after the first updates"
    check = checks[0]
    assert check["predicted_step_s"] == round(engine.plan.predicted_step_s or 0.0, 6)
    assert check["measured_step_s"] > 0 and check["updates"] == 5
    assert check["error"] == pytest.approx(check["predicted_step_s"] / check["measured_step_s"] - 1, abs=1e-3)
    # Peak device memory, measured over the same updates (loosely here; tight in the benchmark).
    assert check["predicted_peak_device_bytes"] == engine.plan.predicted_peak_device_bytes
    ratio = check["predicted_peak_device_bytes"] / check["measured_peak_device_bytes"]
    assert 1 / 3 < ratio < 3, check


def test_a_batch_larger_than_the_profiled_one_is_refused(tmp_path: Path) -> None:
    engine = runtime.initialize(
        tiny_gpt(), config=job(tmp_path, device_budget="64MiB"), example_batch=example()
    )
    assert engine.plan.batch_shape == (2, 32)
    smaller = {key: value[:1, :16] for key, value in example().items()}
    engine(**smaller)  # a smaller batch is fine
    larger = lm_batches(micro_batch_size=4, accumulation=1, world_size=1).batch(0, 0, 0)
    with pytest.raises(
        ValueError, match=r"a batch of shape \(4, 32\) is larger than the \(2, 32\) this plan"
    ):
        engine(**larger)
    engine.close()


def test_profiles_are_cached_by_model_batch_and_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = job(tmp_path, device_budget="2MiB")
    first = runtime.initialize(tiny_gpt(), config=config, example_batch=example())
    first.close()
    cached = sorted(path.name.split("-")[0] for path in (tmp_path / "cache").glob("*.json"))
    assert cached == ["hardware", "model"]

    def no_profiling(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the cached profile should have been used")

    cached_only = Profilers(model=no_profiling)
    again = runtime.initialize(tiny_gpt(), config=config, example_batch=example(), profilers=cached_only)
    knobs = ("chunk_size", "n_persist", "n_buffer", "predicted_step_s", "predicted_peak_device_bytes")
    assert [getattr(again.plan, k) for k in knobs] == [getattr(first.plan, k) for k in knobs]
    again.close()
    # Another batch shape is another profile; so is a refresh.
    bigger = lm_batches(micro_batch_size=4, accumulation=1, world_size=1).batch(0, 0, 0)
    with pytest.raises(AssertionError, match="cached profile"):
        runtime.initialize(
            tiny_gpt(), config={**config, "micro_batch_size": 4}, example_batch=bigger, profilers=cached_only
        )
    monkeypatch.setenv("PROTRAIN_REFRESH_PROFILE", "1")
    with pytest.raises(AssertionError, match="cached profile"):
        runtime.initialize(tiny_gpt(), config=config, example_batch=example(), profilers=cached_only)


class _Timed(torch.nn.Module):
    """A one-parameter model whose forward takes the next of ``durations`` seconds on the
    profiler's clock (a fake one: the test does not depend on how busy the machine is)."""

    def __init__(self, durations: list[float], clock: list[float]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.durations = durations
        self.clock = clock
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock[0] += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1
        return (self.weight * x).sum()


@pytest.mark.parametrize(
    ("durations", "steps_run"),
    [
        ([0.4], 2),  # the warm-up and the first measured step agree: one measured step is enough
        ([0.1, 0.4, 0.41, 0.4], 3),  # a slow start: measured until two steps agree (2.4% apart)
        ([0.1, 0.4, 0.1, 0.4], 4),  # never settled: every step asked for
    ],
)
def test_profiling_stops_once_steps_agree(durations: list[float], steps_run: int) -> None:
    clock = [0.0]
    model = _Timed(durations, clock)
    x = torch.ones(4)
    fp32_profile(model, lambda: model(x), batch_shape=(4,), profile_steps=3, clock=lambda: clock[0])
    assert model.calls == steps_run


def test_profiling_leaves_running_statistics_as_they_were() -> None:
    """Profiling steps are not training: a batch norm's running mean and variance stay put."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    norm = model[1]
    before = {name: buffer.clone() for name, buffer in norm.named_buffers()}
    x = torch.randn(16, 8) * 3 + 1
    fp32_profile(model, lambda: model(x).square().mean(), batch_shape=(16, 8))
    for name, buffer in norm.named_buffers():
        assert torch.equal(buffer, before[name]), name

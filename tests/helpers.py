"""Shared test helpers: tiny models, plain-PyTorch references and the tolerance of DESIGN
section 6."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from protrain_demo.corpus import LMBatches, stdlib_text_corpus
from protrain_demo.gpt import GPT, GPTConfig
from torch import nn

# qkv_bias on, as models have it: the key bias has an exactly-zero gradient (softmax ignores a
# per-query constant), so Adam turns rounding noise into lr-sized steps there and no two fp32
# summation orders agree on it; comparisons with plain PyTorch use assert_matches_reference,
# whose float64 run is the noise floor for such tensors.
TINY_GPT = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
RELATIVE_TOLERANCE = 1e-5
NOISE_FLOOR_FACTOR = 10.0
"""How much farther from the float64 run the engine may be than plain fp32 PyTorch is (DESIGN
section 6): two correct fp32 runs land anywhere within the noise, not at the same place in it."""


TINY_LLAMA: dict[str, int] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
"""A two-layer Hugging Face Llama's config values (transformers is imported by the tests)."""


def tiny_gpt(seed: int = 0, config: GPTConfig = TINY_GPT) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def assert_state_close(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], rtol: float = RELATIVE_TOLERANCE
) -> None:
    """Per tensor: max|a - b| <= rtol * max|b| (DESIGN section 6)."""
    assert set(actual) == set(expected), f"names differ: {set(actual) ^ set(expected)}"
    for name, ref in expected.items():
        got = actual[name].to(ref.dtype)
        diff = (got - ref).abs().max().item()
        bound = rtol * ref.abs().max().item()
        assert diff <= bound, f"{name}: max|a-b| = {diff:.3e} > {bound:.3e}"


def assert_matches_reference(
    actual: Mapping[str, torch.Tensor],
    fp32: Mapping[str, torch.Tensor],
    fp64: Mapping[str, torch.Tensor],
    *,
    rtol: float = RELATIVE_TOLERANCE,
    noise_factor: float = NOISE_FLOOR_FACTOR,
) -> None:
    """DESIGN section 6's oracle against plain PyTorch. Per tensor: max|a - fp32| <= rtol *
    max|fp32|, or, where plain fp32 PyTorch itself is that far from the same training in float64
    (a tensor whose gradient is cancellation noise, e.g. an attention key bias), max|a - fp64| <=
    noise_factor * max|fp32 - fp64|: the engine is no farther from the exact run than PyTorch is.
    A well-conditioned tensor has a float64 floor far below rtol, so a real error fails both."""
    problems = reference_mismatches(actual, fp32, fp64, rtol=rtol, noise_factor=noise_factor)
    assert not problems, problems[0]


def reference_mismatches(
    actual: Mapping[str, torch.Tensor],
    fp32: Mapping[str, torch.Tensor],
    fp64: Mapping[str, torch.Tensor],
    *,
    rtol: float = RELATIVE_TOLERANCE,
    noise_factor: float = NOISE_FLOOR_FACTOR,
) -> list[str]:
    """``assert_matches_reference``'s verdict without raising (for scripts that report every
    result, e.g. scripts/gpu_check.py): one line per tensor the oracle refuses, empty when all
    pass."""
    names = set(fp32)
    if not set(actual) == names == set(fp64):
        return [f"names differ: {(set(actual) ^ names) | (names ^ set(fp64))}"]
    problems = []
    for name, ref in fp32.items():
        got = actual[name].to(ref.dtype)
        diff = (got - ref).abs().max().item()
        bound = rtol * ref.abs().max().item()
        if diff <= bound:
            continue
        exact = fp64[name]
        floor = (ref.to(exact.dtype) - exact).abs().max().item()
        distance = (actual[name].to(exact.dtype) - exact).abs().max().item()
        if distance > noise_factor * floor:
            problems.append(
                f"{name}: max|a-b| = {diff:.3e} > {bound:.3e} (rtol {rtol:g}), and the float64 run does "
                f"not explain it: max|a-fp64| = {distance:.3e} > {noise_factor:g} x {floor:.3e} (plain "
                "fp32 PyTorch's distance from float64)"
            )
    return problems


def assert_state_equal(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, ref in expected.items():
        assert torch.equal(actual[name], ref), f"{name} differs (max {(actual[name] - ref).abs().max():.3e})"


def lm_batches(
    *,
    micro_batch_size: int,
    accumulation: int,
    world_size: int,
    seed: int = 7,
    seq_len: int = TINY_GPT.seq_len,
) -> LMBatches:
    return LMBatches(
        tokens=stdlib_text_corpus(),
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=accumulation,
        world_size=world_size,
        seed=seed,
    )


def reference_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Written independently of runtime.param_groups: biases and LayerNorm weights get no decay."""
    norm_params = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or id(param) in norm_params else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_decaying_by_name(model: nn.Module, no_decay: tuple[str, ...], *, lr: float = 1e-3) -> torch.optim.AdamW:
    """torch's fused AdamW with weight decay 0.1 except for trainable parameters whose names
    contain one of ``no_decay`` (how the spec's default rule lands on Hugging Face models, whose
    biases and norms say so in their names)."""
    params = [p for p in model.parameters() if p.requires_grad]
    exempt = [p for n, p in model.named_parameters() if p.requires_grad and any(s in n for s in no_decay)]
    decay = [p for p in params if all(p is not q for q in exempt)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": exempt, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=True,
    )


def reference_warmup_cosine(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train_updates(engine: Any, data: LMBatches, updates: range, *, rank: int = 0) -> None:
    """One micro-batch per update through an engine: forward, backward, step."""
    for update in updates:
        out = engine(**data.batch(update, 0, rank))
        engine.backward(out.loss)
        engine.step()


def train_reference(
    model: nn.Module,
    data: LMBatches,
    *,
    steps: int,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    clip: float = 0.0,
    schedule: Callable[[int], float] | None = None,
    fused: bool = True,
    norms: list[float] | None = None,
    make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain PyTorch in one process, torch.optim.AdamW, ordinary gradient accumulation
    (``(loss / accumulation).backward()`` per micro-batch). With several ranks' data, each rank's
    micro-batches are accumulated separately and the per-rank gradients averaged, the order in
    which data-parallel training (DDP) sums them; summing every sample in one pass instead would
    differ by rounding that Adam amplifies beyond the tolerance on near-zero gradients.
    ``fused``: torch's fused AdamW kernel, the one the engine runs (bit-exact comparisons);
    False: the default for-loop implementation (comparisons within the tolerance). ``norms``:
    each update's total gradient norm is appended (before clipping, as clip_grad_norm_ returns it).
    ``make_optimizer``: another optimizer over the param groups (lr set per group), instead of AdamW."""
    groups = reference_param_groups(model, weight_decay)
    if make_optimizer is not None:
        optimizer = make_optimizer([{**group, "lr": lr} for group in groups])
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule or (lambda step: 1.0))
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for update in range(steps):
        window = 0.0
        per_rank: list[list[torch.Tensor | None]] = []
        for rank in range(data.world_size):
            for micro in range(data.gradient_accumulation_steps):
                loss = model(**data.batch(update, micro, rank)).loss
                (loss / data.gradient_accumulation_steps).backward()
                window += loss.item()
            per_rank.append([p.grad for p in params])
            for param in params:
                param.grad = None
        for index, param in enumerate(params):
            grads = [rank_grads[index] for rank_grads in per_rank if rank_grads[index] is not None]
            if grads:
                total = grads[0].clone()
                for grad in grads[1:]:
                    total += grad
                param.grad = total / data.world_size if data.world_size > 1 else total
        if norms is not None:
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(window / (data.gradient_accumulation_steps * data.world_size))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp16ReferenceRun:
    """Plain PyTorch's fp16 training: the fp32 parameters, each update's loss (unmultiplied),
    whether it updated (False: skipped for overflow) and the loss scale after it."""

    state: dict[str, torch.Tensor]
    losses: list[float]
    updated: list[bool]
    scales: list[float]


def train_reference_fp16(
    model: nn.Module,
    data: LMBatches,
    *,
    steps: int,
    lr: float,
    weight_decay: float,
    initial_scale: float,
    growth_interval: int,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    loss_multipliers: Mapping[int, float] | None = None,
) -> Fp16ReferenceRun:
    """fp32 parameters, forward under ``torch.autocast(cpu, float16)``, ``torch.amp.GradScaler``
    and the for-loop fp32 ``torch.optim.AdamW`` (one rank). The scaler's settings are the
    engine's loss_scaling semantics (runtime/training/loss_scale.py): halve on overflow (the update is
    skipped), double after ``growth_interval`` clean updates in a row; the engine's min_scale has
    no GradScaler counterpart, so keep the scale above it. ``loss_multipliers``: update -> factor
    on that update's loss before scaling (a loss spike that forces an overflow)."""
    optimizer = torch.optim.AdamW(reference_param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=False)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=initial_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=growth_interval,
    )
    run = Fp16ReferenceRun(state={}, losses=[], updated=[], scales=[])
    for update in range(steps):
        window = 0.0
        for micro in range(data.gradient_accumulation_steps):
            with torch.autocast(device_type="cpu", dtype=torch.float16):
                loss = model(**data.batch(update, micro, 0)).loss
            factor = (loss_multipliers or {}).get(update, 1.0)
            scaler.scale(loss * factor / data.gradient_accumulation_steps).backward()
            window += loss.item()
        before = scaler.get_scale()
        scaler.step(optimizer)  # skipped when a gradient is inf/nan after unscaling
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        # Only an overflow lowers the scale: the update was skipped exactly then.
        run.updated.append(scaler.get_scale() >= before)
        run.scales.append(scaler.get_scale())
        run.losses.append(window / data.gradient_accumulation_steps)
    run.state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return run


def train_reference_float64(model: nn.Module, data: LMBatches, **training: Any) -> dict[str, torch.Tensor]:
    """``train_reference`` in float64 (``model.double()``, the same data, seed and update rule):
    the noise floor of ``assert_matches_reference``. The for-loop AdamW: the fused kernel is the
    engine's fp32 one and need not take float64 on CPU. ``training``: train_reference's keywords."""
    state, _ = train_reference(model.double(), data, **{**training, "fused": False})
    return state


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceRun:
    """Plain PyTorch's training of one model: the fp32 result (what the engine is compared with),
    the same training in float64 (the noise floor) and the fp32 window losses. Cached and shared
    between tests: read, never modify."""

    fp32: dict[str, torch.Tensor]
    fp64: dict[str, torch.Tensor]
    losses: list[float]


@functools.lru_cache(maxsize=16)
def gpt_reference(
    config: GPTConfig = TINY_GPT,
    *,
    seed: int = 0,
    micro_batch_size: int = 2,
    accumulation: int = 1,
    world_size: int = 1,
    steps: int,
    lr: float,
    weight_decay: float,
    clip: float = 0.0,
    warmup_cosine: tuple[int, int, float] | None = None,
) -> ReferenceRun:
    """``tiny_gpt(seed, config)`` trained by plain PyTorch on ``lm_batches`` in fp32 and in
    float64, once per process for each set of arguments (a module's parametrised tests share
    it). ``warmup_cosine``: (warmup, total, min_ratio) of ``reference_warmup_cosine``."""
    data = lm_batches(
        micro_batch_size=micro_batch_size,
        accumulation=accumulation,
        world_size=world_size,
        seq_len=config.seq_len,
    )
    schedule = reference_warmup_cosine(*warmup_cosine) if warmup_cosine else None
    training: dict[str, Any] = {
        "steps": steps,
        "lr": lr,
        "weight_decay": weight_decay,
        "clip": clip,
        "schedule": schedule,
    }
    fp32, losses = train_reference(tiny_gpt(seed, config), data, **training)
    fp64 = train_reference_float64(tiny_gpt(seed, config), data, **training)
    return ReferenceRun(fp32=fp32, fp64=fp64, losses=losses)


def train_engine(
    model: nn.Module, data: LMBatches, config: dict[str, Any], *, steps: int, rank: int = 0
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same training through runtime.initialize; returns the final state and the window losses."""
    from protrain import runtime

    engine = runtime.initialize(model, config=config)
    losses = []
    with engine:
        for update in range(steps):
            window = 0.0
            for micro in range(engine.gradient_accumulation_steps):
                out = engine(**data.batch(update, micro, rank))
                engine.backward(out.loss)
                window += out.loss.item()
                engine.step()
            losses.append(window / engine.gradient_accumulation_steps)
        return engine.state_dict(), losses


def run_script_smoke(script: str, *arguments: str, timeout: float = 60) -> str:
    """``python scripts/<script> --smoke [arguments]`` from the repository root; its stdout,
    after asserting exit code 0 (a benchmark's one-step check that it has not rotted)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "scripts" / script), "--smoke", *arguments],
        cwd=root,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "scripts")])},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{script} --smoke failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout

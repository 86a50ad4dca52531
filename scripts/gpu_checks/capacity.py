"""capacity (issue 17, item 5): Llama-shaped 1B and 3B models in bf16 at seq 2048 under device
budgets of 24 GiB and 78 GiB: which train, at what speed (tokens/s, TFLOPS, MFU), beside plain
PyTorch where it fits on the device, and DeepSpeed ZeRO-3 with CPU offload where installed.

Shapes: Meta's Llama 3.2 1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192) and 3B
(hidden 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192), as their Hugging Face config.json files
give them, with Llama 2's 32000-token vocabulary and untied embeddings (LlamaConfig's defaults):
1.10 B and 3.01 B parameters. ``transformers.LlamaForCausalLM`` built on the meta device and
filled chunk by chunk from ``runtime.model_io.weights.ModelInit`` (engine_runs.meta_model): never whole
in host memory, never whole on the device unless the plan keeps it there.

Each (model, budget): ``runtime.initialize`` with ``memory.device_budget`` set and the rest
planned (it profiles on the example batch), micro-batch 1 x 2048 tokens, 4 micro-batches per
update, bf16, AdamW; one untimed update, then two timed (the engine synchronises the device at
each update). Figures: tokens/s over the timed updates; TFLOPS = tokens/s x FLOPs per token,
with torchtitan's count (``get_num_flop_per_token`` in torchtitan/utils.py: 6 x parameters
without the token embedding + 12 x layers x hidden x seq; causal masking and recompute not
counted); MFU against the H100's dense bf16 peak, 989 TFLOPS; the device's peak allocation
over the timed updates (``runtime.hw.memory_counter``'s window) against the budget.

Plain PyTorch, as a user would train the same model: fp32 weights on the device, bf16 autocast,
``torch.optim.AdamW(fused=True)`` in fp32, the same batches and accumulation; its peak decides
whether it fits either budget; a run out of device memory says so. DeepSpeed: only if
``deepspeed`` can be imported (not on the lent machine: recorded as not installed).

Expected time on one H100 (16 cores, 128 GiB host): per ProTrain run 0.5-1.5 min (the 3B draws
3 B values and registers up to 45 GB of pinned host state; an update at 24 GiB waits for CPU
Adam of most of its parameters on one host thread), each plain run under half a minute: about
6 minutes for the section.

CPU rehearsal: a tiny Llama (2 layers, width 64) under two tiny budgets through the same code;
speed figures only (no MFU), the peak against the budget a figure (the C heap is noisy at these
sizes); whether each trains (finite losses) is checked on both.

CPU counterparts (``CPU_COUNTERPARTS``):
- tests/unit/test_weights.py::test_a_meta_model_is_streamed_one_parameter_at_a_time
- tests/unit/test_weights.py::test_model_init_gives_each_parameter_its_constructors_init
- tests/unit/test_host_model_chunked.py::test_a_model_twice_the_device_budget_is_chunked_within_the_predicted_peak
- tests/unit/test_chunk_engine_hf.py::test_hf_model_with_offloaded_chunks_and_a_frozen_layer
- tests/unit/test_planning.py::test_a_tight_budget_gets_a_searched_plan_that_fits_and_trains_exactly
- tests/unit/test_gpu_check_script.py::test_capacity_rehearsal_trains_under_both_budgets_beside_plain_pytorch
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_checks.common import Context, Section
from gpu_checks.engine_runs import (
    GIB,
    SEED,
    allocated_bytes,
    device_peak,
    free_memory,
    meta_model,
    quiet_initialize,
    where_time_goes,
)

H100_BF16_PEAK_FLOPS = 989e12
"""NVIDIA's H100 SXM dense bf16 figure (torchtitan uses the same)."""
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class LlamaShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    def build(self, seq_len: int) -> torch.nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                num_key_value_heads=self.kv_heads, intermediate_size=self.intermediate,
                vocab_size=self.vocab, max_position_embeddings=seq_len,
            )
        )


LLAMA_1B = LlamaShape(
    "Llama 1B", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=32000
)
LLAMA_3B = LlamaShape(
    "Llama 3B", hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, vocab=32000
)
TINY_LLAMA = LlamaShape("tiny Llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256)


@dataclass(frozen=True, slots=True)
class Sizes:
    models: tuple[LlamaShape, ...]
    budgets: tuple[tuple[str, int], ...]
    """(spec value, bytes)."""
    seq_len: int
    micro_batch: int
    accumulation: int
    warmup_updates: int
    timed_updates: int


GPU = Sizes(
    models=(LLAMA_1B, LLAMA_3B), budgets=(("24GiB", 24 * GIB), ("78GiB", 78 * GIB)),
    seq_len=2048, micro_batch=1, accumulation=4, warmup_updates=1, timed_updates=2,
)
REHEARSAL = Sizes(
    models=(TINY_LLAMA,), budgets=(("2MiB", 2 * MIB), ("256MiB", 256 * MIB)),
    seq_len=32, micro_batch=2, accumulation=2, warmup_updates=1, timed_updates=1,
)


def flops_per_token(model: torch.nn.Module, shape: LlamaShape, seq_len: int) -> int:
    """torchtitan's count: 6 x the parameters less the token embedding (the output head is a
    matmul: it counts) + 12 x layers x hidden x seq for attention's two matmuls (forward and
    backward, every position: causal masking is not subtracted)."""
    embedding = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return 6 * (params - embedding) + 12 * shape.layers * shape.hidden * seq_len


@dataclass(frozen=True, slots=True)
class Speed:
    losses: list[float]
    seconds: float
    tokens: int
    peak_bytes: int

    @property
    def finite(self) -> bool:
        return all(math.isfinite(loss) for loss in self.losses)

    def figures(self, flops: int, cuda: bool) -> dict[str, Any]:
        tokens_per_s = self.tokens / self.seconds
        tflops = tokens_per_s * flops / 1e12
        return {
            "tokens_per_s": round(tokens_per_s, 1),
            "tflops": round(tflops, 2),
            "mfu_pct": round(100 * tflops * 1e12 / H100_BF16_PEAK_FLOPS, 2) if cuda else None,
            "peak_gib": round(self.peak_bytes / GIB, 3),
            "last_loss": round(self.losses[-1], 4) if self.losses else None,
        }


def hf_batches(shape: LlamaShape, sizes: Sizes) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """Batch (update, micro) of byte-level text; Hugging Face's models shift labels themselves."""
    from protrain_demo.corpus import LMBatches, stdlib_text_corpus

    data = LMBatches(
        tokens=stdlib_text_corpus() % shape.vocab, seq_len=sizes.seq_len, micro_batch_size=sizes.micro_batch,
        gradient_accumulation_steps=sizes.accumulation, world_size=1, seed=SEED,
    )

    def batch(update: int, micro: int) -> dict[str, torch.Tensor]:
        ids = data.batch(update, micro, 0)["input_ids"]
        return {"input_ids": ids, "labels": ids}

    return batch


def timed_training(
    ctx: Context,
    model: torch.nn.Module,
    micro_step: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    finish_update: Callable[[], None],
    batch: Callable[[int, int], dict[str, torch.Tensor]],
    sizes: Sizes,
    baseline: int,
) -> Speed:
    """Warm-up updates, then timed ones with the device's peak read over them. ``micro_step``
    runs forward and backward of one micro-batch and returns its loss; ``finish_update`` ends
    the update (the optimizer step)."""
    losses: list[torch.Tensor] = []

    def updates(numbers: range) -> None:
        for update in numbers:
            for micro in range(sizes.accumulation):
                losses.append(micro_step(batch(update, micro)).detach())
            finish_update()

    updates(range(sizes.warmup_updates))
    ctx.synchronize()
    with device_peak(ctx.device, model) as peak:
        started = time.perf_counter()
        updates(range(sizes.warmup_updates, sizes.warmup_updates + sizes.timed_updates))
        ctx.synchronize()
        seconds = time.perf_counter() - started
    tokens = sizes.timed_updates * sizes.accumulation * sizes.micro_batch * sizes.seq_len
    return Speed([float(loss) for loss in losses], seconds, tokens, peak() - baseline)


def protrain(ctx: Context, shape: LlamaShape, budget: str, sizes: Sizes) -> tuple[Speed, Any, float]:
    """ProTrain under the device budget: its speed, its plan and initialize's seconds."""
    model, weights = meta_model(lambda: shape.build(sizes.seq_len))
    batch = hf_batches(shape, sizes)
    spec = {
        "seed": SEED,
        "micro_batch_size": sizes.micro_batch,
        "gradient_accumulation_steps": sizes.accumulation,
        "precision": "bf16",
        "optimizer": {"lr": 1e-4, "weight_decay": 0.1},
        "memory": {"device_budget": budget},
        "profiler": {"cache_dir": str(ctx.scratch / "cache")},
        "output_dir": str(ctx.scratch / "runs"),
    }
    free_memory(ctx.device)
    baseline = allocated_bytes(ctx.device)
    started = time.perf_counter()
    # Sampled on a GPU only: the sampler briefly holds the caller's frames, and so their tensors,
    # which the CPU rehearsal's tight device wall can count (a failure seen under a loaded CI).
    sampling = where_time_goes(f"ProTrain initialize, {shape.name}") if ctx.is_cuda else contextlib.nullcontext()
    with sampling:
        engine = quiet_initialize(model, spec, example_batch=batch(0, 0), weights=weights)
    initialize_s = time.perf_counter() - started

    def micro_step(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = engine(**micro_batch).loss
        engine.backward(loss)
        engine.step()
        return loss

    with engine:
        speed = timed_training(ctx, engine.module, micro_step, lambda: None, batch, sizes, baseline)
        return speed, engine.plan, initialize_s


def plain_pytorch(ctx: Context, shape: LlamaShape, sizes: Sizes) -> Speed:
    """The same model as a user trains it without ProTrain: fp32 weights on the device, bf16
    autocast, fused fp32 AdamW."""
    free_memory(ctx.device)
    baseline = allocated_bytes(ctx.device)
    with torch.device(ctx.device):
        torch.manual_seed(SEED)
        model = shape.build(sizes.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    batch = hf_batches(shape, sizes)

    def micro_step(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        on_device = {k: v.to(ctx.device, non_blocking=True) for k, v in micro_batch.items()}
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            loss = model(**on_device).loss
        (loss / sizes.accumulation).backward()
        return loss

    def finish_update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed_training(ctx, model, micro_step, finish_update, batch, sizes, baseline)


def speed_words(figures: dict[str, Any]) -> str:
    mfu = "n/a off CUDA" if figures["mfu_pct"] is None else f"{figures['mfu_pct']}%"
    return f"{figures['tokens_per_s']} tokens/s, {figures['tflops']} TFLOPS, MFU {mfu}"


def plan_words(plan: Any) -> str:
    return (
        f"n_persist {plan.n_persist}/{plan.num_chunks}, n_buffer {plan.n_buffer}, swap {plan.n_swap}, "
        f"checkpoint {plan.n_checkpoint}, ssd {plan.n_offload}"
    )


def run_protrain(ctx: Context, shape: LlamaShape, flops: int, sizes: Sizes) -> None:
    from protrain.runtime.config.spec_io import SpecError

    for budget, budget_bytes in sizes.budgets:
        name = f"{shape.name} @ {budget}"
        try:
            speed, plan, initialize_s = protrain(ctx, shape, budget, sizes)
            refused = ""
        except (SpecError, torch.OutOfMemoryError) as error:
            refused = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        free_memory(ctx.device)  # after the except block: the error's frames hold the engine until then
        if refused:
            ctx.check(f"{name}: trains", False, refused)
            continue
        figures = speed.figures(flops, ctx.is_cuda)
        ctx.check(
            f"{name}: trains",
            speed.finite,
            f"{speed_words(figures)}; "
            f"{'finite losses' if speed.finite else 'NON-FINITE losses'}; {plan_words(plan)}",
            **figures,
            n_persist=plan.n_persist,
            num_chunks=plan.num_chunks,
            initialize_s=round(initialize_s, 1),
            predicted_peak_gib=None if plan.predicted_peak_device_bytes is None
            else round(plan.predicted_peak_device_bytes / GIB, 3),
        )
        within = speed.peak_bytes <= budget_bytes
        ctx.check(
            f"{name}: peak within the budget",
            within if ctx.is_cuda else None,
            f"{speed.peak_bytes / GIB:.2f} GiB at most over the timed updates, budget {budget}"
            + ("" if ctx.is_cuda else "; CPU heap figure: judged on CUDA"),
            peak_gib=round(speed.peak_bytes / GIB, 3),
        )


def run_plain(ctx: Context, shape: LlamaShape, flops: int, sizes: Sizes) -> None:
    name = f"{shape.name}: plain PyTorch (bf16 autocast, fp32 AdamW)"
    try:
        speed = plain_pytorch(ctx, shape, sizes)
        refused = ""
    except torch.OutOfMemoryError as error:
        refused = str(error).splitlines()[0][:200]
    free_memory(ctx.device)  # after the except block: the error's frames hold the model until then
    if refused:
        ctx.check(name, None, f"does not fit on the device: {refused}", fits=False)
        return
    figures = speed.figures(flops, ctx.is_cuda)
    fits = {f"fits_{budget}": speed.peak_bytes <= limit for budget, limit in sizes.budgets}
    ctx.check(
        name,
        None if speed.finite else False,
        f"{speed_words(figures)}, peak {figures['peak_gib']} GiB ("
        + ", ".join(f"{'fits' if ok else 'over'} {key[5:]}" for key, ok in fits.items())
        + ")",
        **figures,
        **fits,
    )


def run(ctx: Context) -> None:
    sizes = REHEARSAL if ctx.rehearsal else GPU
    for shape in sizes.models:
        model, _ = meta_model(lambda shape=shape: shape.build(sizes.seq_len))
        flops = flops_per_token(model, shape, sizes.seq_len)
        params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        del model
        ctx.check(
            f"{shape.name}: shape", None,
            f"{params / 1e9:.4g} B parameters, {flops / 1e9:.4g} GFLOP per token at seq {sizes.seq_len} "
            f"(torchtitan's count); micro-batch {sizes.micro_batch} x {sizes.accumulation} per update",
            params=params, flops_per_token=flops,
        )
        run_protrain(ctx, shape, flops, sizes)
        run_plain(ctx, shape, flops, sizes)
    installed = importlib.util.find_spec("deepspeed") is not None
    ctx.check(
        "DeepSpeed ZeRO-3 with CPU offload", None,
        "installed, not run by this section (scripts/bench_peers.py has a ZeRO-3 runner)" if installed
        else "not installed",
        installed=installed,
    )


CPU_COUNTERPARTS = (
    "tests/unit/test_weights.py::test_a_meta_model_is_streamed_one_parameter_at_a_time",
    "tests/unit/test_weights.py::test_model_init_gives_each_parameter_its_constructors_init",
    "tests/unit/test_host_model_chunked.py::"
    "test_a_model_twice_the_device_budget_is_chunked_within_the_predicted_peak",
    "tests/unit/test_chunk_engine_hf.py::test_hf_model_with_offloaded_chunks_and_a_frozen_layer",
    "tests/unit/test_planning.py::test_a_tight_budget_gets_a_searched_plan_that_fits_and_trains_exactly",
    "tests/unit/test_gpu_check_script.py::"
    "test_capacity_rehearsal_trains_under_both_budgets_beside_plain_pytorch",
)
"""The suite's tests that check on CPU what this section checks on the GPU."""


SECTION = Section(
    name="capacity",
    title="Llama 1B and 3B in bf16 at seq 2048 under 24 and 78 GiB: which train, how fast",
    run=run,
    cpu_counterpart=", ".join(CPU_COUNTERPARTS),
)

"""Stage ``capacity_peer`` of the first-contact run: a 1B Llama (``transformers.LlamaConfig``,
random weights, no hub) at a 24 GiB device cap, trained by ProTrain's plan and by FSDP2 with CPU
offload on the same model, batch and cap, one after the other in this process, each timed and
peak-measured by the same code (capacity.timed_training: warm-up updates, then timed ones with
the device's peak read through ``runtime.hw.memory_counter`` at every module and gradient).

- The cap: ``torch.cuda.set_per_process_memory_fraction(24 GiB / the card)`` before either runs
  (the caching allocator refuses past it, as a 24 GiB card would); ProTrain also gets
  ``memory.device_budget: 24GiB`` and plans for it.
- The model: Meta's Llama 3.2 1B shape with Llama 2's 32000-token vocabulary (capacity.LLAMA_1B:
  1.10 B parameters), sequence 2048, micro-batch 1, 2 micro-batches per update, bf16 compute
  with fp32 master weights and fp32 AdamW (lr 1e-4, weight decay 0.1) in both.
- ProTrain: ``runtime.initialize`` on the meta-device model filled chunk by chunk, the rest
  planned (capacity.protrain).
- FSDP2: a process group of one (NCCL on CUDA, gloo on CPU, an in-memory store), the model built
  on the host, ``fully_shard`` on every decoder layer and the root with
  ``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients and the optimizer on the host; the
  copies pinned) and ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; the loss
  divided by the accumulation; ``torch.optim.AdamW(fused=True)`` over the sharded parameters on
  the host.

Figures: tokens/s, TFLOPS and MFU (torchtitan's FLOP count, the H100's dense bf16 peak), the
device's peak over the timed updates against the cap, and ProTrain's speed over FSDP2's.

The rehearsal: the tiny Llama (capacity.TINY_LLAMA), no cap (the CPU has no allocator to cap),
ProTrain at a 256 MiB budget, FSDP2's CPU offload between CPU tensors with ``pin_memory=False``
(pinning needs CUDA): the same code, CPU figures.

Expected on one H100: ProTrain's initialize 30-45 s (1.1 B values drawn, up to 17 GB of pinned
host state, probes, profiling) and its updates a few seconds; FSDP2's model built in 5-10 s, its
updates (4.4 GB up twice and down once per micro-batch, AdamW over 1.1 B parameters on the host)
5-10 s: 60-80 s.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gpu_checks import capacity
from gpu_checks.common import Context, Section
from gpu_checks.engine_runs import GIB, SEED, allocated_bytes, free_memory, meta_model

GPU = capacity.Sizes(
    models=(capacity.LLAMA_1B,), budgets=(("24GiB", 24 * GIB),),
    seq_len=2048, micro_batch=1, accumulation=2, warmup_updates=1, timed_updates=2,
)
MIB = 1 << 20
REHEARSAL = capacity.Sizes(
    models=(capacity.TINY_LLAMA,), budgets=(("256MiB", 256 * MIB),),
    seq_len=32, micro_batch=2, accumulation=2, warmup_updates=1, timed_updates=1,
)


def cap(ctx: Context, budget: str, nbytes: int) -> None:
    if not ctx.is_cuda:
        ctx.check("device cap", None, "CPU: no allocator to cap; ProTrain plans for its budget", budget=budget)
        return
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    torch.cuda.set_per_process_memory_fraction(nbytes / total, ctx.device)
    ctx.check(
        "device cap", True, f"set_per_process_memory_fraction({nbytes / total:.4f}): {budget} of {total / GIB:.1f} GiB",
        budget=budget, fraction=round(nbytes / total, 5),
    )


def fsdp2(ctx: Context, shape: capacity.LlamaShape, sizes: capacity.Sizes) -> capacity.Speed:
    """FSDP2 with CPU offload in a process group of one; destroyed after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl" if ctx.is_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        free_memory(ctx.device)
        baseline = allocated_bytes(ctx.device)
        torch.manual_seed(SEED)
        # Built and initialised on the device (the host's initialisation of 1.1B parameters outran the
        # stage's timeout on the first GPU run); fully_shard's offload policy moves the shards to
        # the host, pinned, and the full tensors are freed before anything is timed.
        with torch.device(ctx.device):
            model = shape.build(sizes.seq_len)
        mesh = init_device_mesh(ctx.device.type, (1,))
        policy = CPUOffloadPolicy(pin_memory=ctx.is_cuda)
        precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=policy, mp_policy=precision)
        fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=precision)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        batch = capacity.hf_batches(shape, sizes)

        def micro_step(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
            on_device = {k: v.to(ctx.device, non_blocking=True) for k, v in micro_batch.items()}
            loss = model(**on_device).loss
            (loss / sizes.accumulation).backward()
            return loss

        def finish_update() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return capacity.timed_training(ctx, model, micro_step, finish_update, batch, sizes, baseline)
    finally:
        dist.destroy_process_group()


def run(ctx: Context) -> None:
    from protrain.runtime.config.spec_io import SpecError

    sizes = REHEARSAL if ctx.rehearsal else GPU
    (shape,), ((budget, budget_bytes),) = sizes.models, sizes.budgets
    cap(ctx, budget, budget_bytes)
    model, _ = meta_model(lambda: shape.build(sizes.seq_len))
    flops = capacity.flops_per_token(model, shape, sizes.seq_len)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    del model
    ctx.check(
        f"{shape.name}: shape", None,
        f"{params / 1e9:.4g} B parameters, {flops / 1e9:.4g} GFLOP per token at seq {sizes.seq_len}; "
        f"micro-batch {sizes.micro_batch} x {sizes.accumulation} per update, {sizes.timed_updates} timed",
        params=params, flops_per_token=flops,
    )
    speeds: dict[str, Any] = {}
    try:
        speed, plan, initialize_s = capacity.protrain(ctx, shape, budget, sizes)
        refused = ""
    except (SpecError, torch.OutOfMemoryError) as error:
        refused = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    free_memory(ctx.device)  # after the except block: the error's frames hold the engine until then
    if refused:
        ctx.check(f"ProTrain @ {budget}", False, refused)
    else:
        speeds["ProTrain"] = speed
        report(ctx, f"ProTrain @ {budget}", speed, flops, budget_bytes,
               f"{capacity.plan_words(plan)}; initialize {initialize_s:.1f} s",
               n_persist=plan.n_persist, num_chunks=plan.num_chunks, initialize_s=round(initialize_s, 1))
    peer = f"FSDP2 + CPUOffloadPolicy(pin_memory={ctx.is_cuda}) @ {budget}"
    try:
        speeds["FSDP2"] = fsdp2(ctx, shape, sizes)
        refused = ""
    except torch.OutOfMemoryError as error:
        refused = f"out of memory: {str(error).splitlines()[0][:300]}"
    free_memory(ctx.device)
    if refused:
        ctx.check(peer, None, f"does not fit: {refused}", fits=False)
    else:
        note = "" if ctx.is_cuda else "pin_memory=False: pinning needs CUDA"
        report(ctx, peer, speeds["FSDP2"], flops, budget_bytes, note)
    if len(speeds) == 2:
        ours, theirs = (speeds[k].tokens / speeds[k].seconds for k in ("ProTrain", "FSDP2"))
        ctx.check(
            "ProTrain vs FSDP2 (tokens/s)", None,
            f"{ours:.1f} vs {theirs:.1f} tokens/s: x{ours / theirs:.2f}; peaks "
            f"{speeds['ProTrain'].peak_bytes / GIB:.2f} vs {speeds['FSDP2'].peak_bytes / GIB:.2f} GiB",
            speedup=round(ours / theirs, 3),
        )


def report(
    ctx: Context, name: str, speed: capacity.Speed, flops: int, cap_bytes: int, words: str, **extra: Any
) -> None:
    figures = speed.figures(flops, ctx.is_cuda)
    within = speed.peak_bytes <= cap_bytes
    finite = all(math.isfinite(loss) for loss in speed.losses)
    ctx.check(
        name,
        finite and (within if ctx.is_cuda else True),
        f"{capacity.speed_words(figures)}; peak {speed.peak_bytes / GIB:.3f} GiB "
        f"({'within' if within else 'OVER'} the cap{'' if ctx.is_cuda else ': a CPU heap figure'}); "
        f"{'finite losses' if finite else 'NON-FINITE losses'}" + (f"; {words}" if words else ""),
        **figures,
        **extra,
    )


SECTION = Section(
    name="capacity_peer",
    title="a 1B Llama at a 24 GiB cap: ProTrain's plan beside FSDP2 with CPU offload, timed and peak-measured",
    run=run,
    cpu_counterpart="tests/e2e/test_bench_peers_smoke.py (FSDP2 beside ProTrain on CPU ranks), "
    + capacity.SECTION.cpu_counterpart,
)

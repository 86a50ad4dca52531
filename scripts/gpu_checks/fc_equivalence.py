"""Stage ``equivalence`` of the first-contact run: the equivalence section's cases (equivalence.py)
after two more, run first since they say the most per second on a GPU:

- one mid-size, GPU-bound case: a GPT of 8 blocks of width 768 (57M parameters; sequence 512,
  batch 8) in fp32 with half the chunks offloaded through 2 buffers, 4 updates, against plain
  PyTorch by DESIGN section 6's oracle (1e-5 per tensor, else within 10x plain fp32's distance
  from float64). Its matmuls take milliseconds, so timing and stream order are a GPU's, not a
  launch-bound toy's. The rehearsal: a GPT of 2 blocks of width 128.
- bf16 with every chunk offloaded against bf16 with every chunk resident, same batches, same
  seed: the only difference is where the fp32 masters live and which Adam updates them (the
  host's fused kernel or the device's). At a tight tolerance: losses within 0.1% at every update
  and the parameters' distance at most 1% of what training changed them (the suite's bf16
  comparison against autocast allows 2% and 10%: that one compares different arithmetic, this
  one the same arithmetic in two places). Whether they are bit-equal is a figure.

Then the equivalence section itself (plans, block modes, clipping, a hand-set budget, the
sanitized child). Expected on one H100: the two new cases 15-25 s, the section about 1.5 minutes.
"""

from __future__ import annotations

import dataclasses

import torch

from gpu_checks import equivalence
from gpu_checks.common import Context, Section
from gpu_checks.training import PoolReads, Sizes, chunk_bytes, sizes
from protrain_demo.gpt import GPTConfig

MID_GPU = dict(vocab_size=256, seq_len=512, n_layer=8, n_head=12, d_model=768)
MID_REHEARSAL = dict(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=96)
PLACEMENT_LOSS_RTOL = 1e-3
PLACEMENT_UPDATE_RTOL = 1e-2


def mid_size(ctx: Context) -> None:
    config = GPTConfig(**(MID_REHEARSAL if ctx.rehearsal else MID_GPU))
    size = Sizes(model=config, micro_batch=2 if ctx.rehearsal else 8, steps=3 if ctx.rehearsal else 4)
    model = equivalence._model(size)
    total = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
    chunk = chunk_bytes(model, element_size=4, min_chunks=8)
    del model
    reference = equivalence._reference(ctx, size, clip=0.0)
    case = equivalence.Case(name="mid-size GPT, fp32, half the chunks offloaded", persistent=0.5)
    keep = ["keep"] * config.n_layer
    memory = {"chunk_size": chunk, "n_persist": total // chunk // 2, "n_buffer": 2, "block_modes": keep}
    tally = PoolReads()
    result = equivalence._train(ctx, size, case, memory, tally=tally)
    equivalence._judge_fp32(ctx, case.name, result, reference)
    ctx.check(
        "mid-size GPT: shape", None,
        f"{total / 4e6:.2f}M parameters, {config.n_layer} blocks of width {config.d_model}, sequence "
        f"{config.seq_len}, micro-batch {size.micro_batch}",
        params=total // 4, micro_batch=size.micro_batch, seq_len=config.seq_len,
    )
    _pool_check(ctx, case.name, tally)


def bf16_placement(ctx: Context) -> None:
    size = sizes(ctx)
    offloaded_case = equivalence.Case(name="bf16, every chunk offloaded", precision="bf16", persistent=0.0)
    tally = PoolReads()
    memory = equivalence._memory(size, offloaded_case, 0)
    offloaded = equivalence._train(ctx, size, offloaded_case, memory, tally=tally)
    resident_case = dataclasses.replace(offloaded_case, name="bf16, every chunk resident", persistent=1.0)
    num_chunks = offloaded.plan["num_chunks"]
    resident = equivalence._train(
        ctx, size, resident_case, equivalence._memory(size, resident_case, num_chunks), tally=tally
    )
    initial = equivalence._model(size)
    names = [n for n, _ in initial.named_parameters()]  # tied weights once
    start = initial.state_dict()
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(offloaded.losses, resident.losses, strict=True))
    distance = torch.cat([(offloaded.state[n] - resident.state[n]).flatten() for n in names]).norm()
    trained = torch.cat([(resident.state[n] - start[n]).flatten() for n in names]).norm()
    relative = (distance / trained).item()
    bit_equal = all(torch.equal(offloaded.state[n], resident.state[n]) for n in names)
    ctx.check(
        "bf16 offloaded vs bf16 resident (tight)",
        worst_loss <= PLACEMENT_LOSS_RTOL and relative <= PLACEMENT_UPDATE_RTOL
        and resident.plan["n_persist"] == num_chunks and offloaded.plan["n_persist"] == 0,
        f"{len(resident.losses)} updates, n_persist 0 vs {resident.plan['n_persist']}/{num_chunks}: losses within "
        f"{PLACEMENT_LOSS_RTOL:.1%} (worst {worst_loss:.2e}); parameters' distance {relative:.2e} of what "
        f"training changed (<= {PLACEMENT_UPDATE_RTOL:.0%}); bit-equal: {bit_equal}",
        worst_loss_gap=worst_loss,
        update_distance=relative,
        bit_equal=bit_equal,
        num_chunks=num_chunks,
        offloaded_updates=offloaded.update_mode,
    )
    _pool_check(ctx, "bf16 offloaded and resident", tally)


def _pool_check(ctx: Context, what: str, tally: PoolReads) -> None:
    problems = tally.problems
    ctx.check(
        f"{what}: parameters read from the device pool",
        not problems,
        "; ".join(problems[:3]) or "every module's parameters inside the device buffers or a persistent chunk",
        outside=len(problems),
    )


def run(ctx: Context) -> None:
    if ctx.is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # plain PyTorch's default, as the section sets it
    mid_size(ctx)
    bf16_placement(ctx)
    equivalence.run(ctx)


SECTION = Section(
    name="equivalence",
    title="a mid-size GPU-bound case, bf16 offloaded vs resident, then every plan and mode vs plain PyTorch",
    run=run,
    cpu_counterpart=equivalence.SECTION.cpu_counterpart,
)

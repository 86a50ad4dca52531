"""Section ``checkpoint``: save and exact resume on the device.

The suite's checkpoint run (``tests.checkpointing.train_until``: dropout 0.1, 2 accumulation
steps, warmup-cosine schedule, batches from the engine's resumable data loader) at the run's
model size (the GPT of 4 blocks of width 256; the rehearsal: the tiny GPT with 4 blocks). Per
case, a first run trains N updates, saves a checkpoint (``checkpoint.interval_steps`` N) and
trains M more; a second run, a fresh engine in the same process, resumes from that checkpoint
(``checkpoint.resume`` naming it) and trains the same M. It must start at update N, end with every
parameter bit-equal to the first run's, and report bit-equal losses for the M updates (so the
parameters, Adam moments and step counts, the schedule, the data position and the CPU and CUDA
random streams all came back). N, M = 4, 3 (2, 2 in the rehearsal). Cases:

- fp32, 1 chunk persistent and the rest offloaded: the offloaded chunks' optimizer state lives
  on the host (CPU Adam), the persistent chunk's on the device; synchronous save;
- bf16 with the same plan and an asynchronous save (fp32 masters saved, bf16 copies rebuilt);
- fp32 with every chunk resident: all optimizer state on the device.

Attention runs on PyTorch's math kernel here (``sdpa_kernel(MATH)``, on CPU too, so the
rehearsal takes the same path): the fused kernels' backward (memory-efficient for fp32, flash
for bf16) may accumulate with atomics in an order that varies between runs, which would make two
uninterrupted runs differ in the last bit as well; bit-equality is about what ProTrain restores.

Expected time on one H100: under a minute (six short runs); the rehearsal about 6 s.

CPU counterparts: tests/unit/test_checkpoint.py (stopped and resumed runs end bit-identical,
fp16's loss scale resumed) and tests/distributed/test_checkpoint_two_ranks.py (two ranks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_checks.common import Context, Section


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    model: Any
    """The GPT's config (dropout on)."""
    before: int
    """Updates before the save."""
    after: int
    """Updates after it, in both runs."""


def run(ctx: Context) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gpu_checks import training
    from protrain_demo.gpt import GPT

    plan = Resume(
        model=dataclasses.replace(training.sizes(ctx).model, dropout=0.1),
        before=2 if ctx.rehearsal else 4,
        after=2 if ctx.rehearsal else 3,
    )
    model = GPT(plan.model)

    def memory(element_size: int, n_persist: int, n_buffer: int = 2) -> dict[str, Any]:
        chunk = training.chunk_bytes(model, element_size=element_size, min_chunks=8)
        return {
            "chunk_size": chunk,
            "n_persist": n_persist,
            "n_buffer": n_buffer,
            "block_modes": ["keep"] * 4,
        }

    with sdpa_kernel(SDPBackend.MATH):
        host = "optimizer state on the host (1 chunk persistent)"
        offloaded = _case(ctx, f"fp32, {host}, synchronous save", {"memory": memory(4, 1)}, plan)
        bf16 = {"memory": memory(2, 1), "precision": "bf16", "checkpoint": {"async_save": True}}
        _case(ctx, f"bf16, {host}, asynchronous save", bf16, plan)
        every = offloaded["offloaded_chunks"] + 1
        resident = {"memory": memory(4, every, n_buffer=0)}
        _case(ctx, "fp32, every chunk resident: optimizer state on the device", resident, plan)


def _case(ctx: Context, name: str, overrides: dict[str, Any], plan: Resume) -> dict[str, Any]:
    """The first run (saves at update ``before``, goes on to ``before + after``) and the resumed
    run; one check; the first run's result."""
    from gpu_checks.training import to_cpu, unequal
    from tests.checkpointing import checkpoint_job, train_until

    root = ctx.scratch / f"case-{len(ctx.report.checks)}"
    saving = {**overrides, "checkpoint": {**overrides.get("checkpoint", {}), "interval_steps": plan.before}}
    first = train_until(
        checkpoint_job(str(root), **saving), until=plan.before + plan.after, model_config=plan.model
    )
    # Named by path: with M >= N the first run saved again at 2N, which ``resume: auto`` would take.
    saved = root / "ckpt" / f"step-{plan.before:08d}"
    resuming = {**overrides, "checkpoint": {**overrides.get("checkpoint", {}), "resume": str(saved)}}
    resumed = train_until(
        checkpoint_job(str(root), **resuming), until=plan.before + plan.after, model_config=plan.model
    )
    differ = unequal(to_cpu(resumed["state"]), to_cpu(first["state"]))
    same_losses = resumed["losses"] == first["losses"][plan.before :]
    started = (
        resumed["started_at"] == plan.before
        and Path(str(resumed["resumed_from"])).resolve() == saved.resolve()
    )
    ctx.check(
        name,
        started and same_losses and not differ and len(first["losses"]) == plan.before + plan.after,
        f"saved at update {plan.before} of {plan.before + plan.after}; the fresh engine resumed at update "
        f"{resumed['started_at']} from {resumed['resumed_from']}; its {plan.after} losses "
        f"{'equal' if same_losses else 'DIFFER'} bit for bit; final parameters "
        + ("bit-equal" if not differ else f"differ in {', '.join(differ[:3])}"),
        offloaded_chunks=first["offloaded_chunks"],
        losses_first=str(first["losses"][plan.before :]),
        losses_resumed=str(resumed["losses"]),
        tensors_differing=len(differ),
    )
    return first


SECTION = Section(
    name="checkpoint",
    title="save and exact resume on the device (fp32 and bf16, optimizer state on host and device)",
    run=run,
    cpu_counterpart=(
        "tests/unit/test_checkpoint.py::test_stopped_and_resumed_run_ends_bit_identical, "
        "tests/unit/test_checkpoint.py::test_fp16_loss_scale_and_skipped_updates_are_resumed, "
        "tests/distributed/test_checkpoint_two_ranks.py::test_two_rank_run_resumed_ends_bit_identical"
    ),
)

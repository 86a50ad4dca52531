"""Stage ``checkpoint`` of the first-contact run: save, exact resume and export under the strict
device wall (``PROTRAIN_STRICT_DEVICE=1``, which first_contact.py sets for this stage), with a
model whose fp32 weights alone are larger than the wall.

Under the wall every byte allocated on the device while an engine call runs counts against
``memory.device_budget`` (on CUDA through ``set_per_process_memory_fraction``, on CPU by the
wall's own count): a save, a resume or an export that gathered the model whole would stop at
once. The wall is set at three quarters of the model's fp32 weight bytes (3/16 of its training state)
plus the math libraries' device workspaces (runtime/hw/math_workspaces.py: 64 MiB on an H100, 0
on CPU), which every step holds beside the model: a first run without them ran out of memory on
them, 104 MiB allocated of a 122 MiB wall. A gather of the whole model still cannot fit.

The model: the repository's GPT with dropout 0.1 at sequence 32 (the checkpoint tests' dataset),
on the GPU 6 blocks of width 768 (43M parameters, 170 MB of fp32 weights, a wall of 128 MB), in
the rehearsal 4 blocks of width 256 (3.2M parameters, 12.9 MB, a wall of 9.7 MB: narrower, the
activations of a batch would outweigh the weights). Plans set by hand, chunks of at least 1/18 of
the model, offloaded chunks passing through 2 buffers:

- fp32, every chunk offloaded (all optimizer state on the host), synchronous save; bf16, one
  chunk persistent (its fp32 master and moments on the device), asynchronous save. Each is the
  checkpoint section's case (checkpoint.py): a run saves at update N and goes on to N + M, a
  fresh engine resumes from that save and trains the same M; its losses and final parameters
  must be bit-equal.
- export: a fresh engine resumes the fp32 save and exports safetensors (streamed out of the
  chunks); the file, loaded into a plain GPT, must equal the engine's ``state_dict`` bit for bit.

Expected on one H100: 15-30 s (five engines; 0.5 GB of checkpoint per save); the rehearsal 6 s.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gpu_checks import checkpoint
from gpu_checks.common import Context, Section

WALL_SHARE = 0.75
"""Of the model's fp32 weight bytes."""
GPU_MODEL = dict(vocab_size=256, seq_len=32, n_layer=6, n_head=12, d_model=768)
"""Sequence 32: the checkpoint tests' dataset (tests/checkpointing.py) has windows of 32 tokens."""
REHEARSAL_MODEL = dict(vocab_size=256, seq_len=32, n_layer=4, n_head=4, d_model=256)
MIB = 1 << 20


def run(ctx: Context) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gpu_checks import training
    from protrain.runtime.hw import device_wall
    from protrain.runtime.hw.device import DeviceInfo
    from protrain.runtime.hw.math_workspaces import library_workspace_bytes
    from protrain_demo.gpt import GPT, GPTConfig

    config = GPTConfig(**(REHEARSAL_MODEL if ctx.rehearsal else GPU_MODEL), dropout=0.1)
    plan = checkpoint.Resume(model=config, before=2 if ctx.rehearsal else 4, after=2 if ctx.rehearsal else 3)
    model = GPT(config)
    weights = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
    workspaces = library_workspace_bytes(DeviceInfo(ctx.device, "nccl" if ctx.is_cuda else "gloo"))
    wall = math.ceil((WALL_SHARE * weights + workspaces) / 4096) * 4096

    def memory(element_size: int, n_persist: int) -> dict[str, Any]:
        return {
            "chunk_size": training.chunk_bytes(model, element_size=element_size, min_chunks=16),
            "n_persist": n_persist,
            "n_buffer": 2,
            "block_modes": ["keep"] * config.n_layer,
            "device_budget": wall,
        }

    strict = device_wall.strict()
    ctx.check(
        "the device wall is up, below the model",
        strict and wall - workspaces < weights,
        f"PROTRAIN_STRICT_DEVICE {'on' if strict else 'OFF'}; wall (device_budget) {wall / MIB:.2f} MiB, "
        f"of which the math libraries' workspaces {workspaces / MIB:.2f} MiB; the model's fp32 weights "
        f"{weights / MIB:.2f} MiB, its training state {4 * weights / MIB:.2f} MiB",
        wall_bytes=wall,
        workspace_bytes=workspaces,
        weight_bytes=weights,
        strict=strict,
    )
    with sdpa_kernel(SDPBackend.MATH):  # bit-equality needs kernels without atomics (checkpoint.py)
        fp32_root = ctx.scratch / f"case-{len(ctx.report.checks)}"
        fp32 = {"memory": memory(4, 0)}
        checkpoint._case(ctx, "under the wall: fp32, every chunk offloaded, synchronous save", fp32, plan)
        bf16 = {"memory": memory(2, 1), "precision": "bf16", "checkpoint": {"async_save": True}}
        checkpoint._case(ctx, "under the wall: bf16, 1 chunk persistent, asynchronous save", bf16, plan)
        export(ctx, config, fp32_root, fp32, plan)


def export(ctx: Context, config: Any, root: Path, overrides: dict[str, Any], plan: checkpoint.Resume) -> None:
    """A fresh engine resumes the fp32 case's save and exports; the file equals its state."""
    from gpu_checks.training import to_cpu, unequal
    from protrain import runtime
    from protrain.runtime.model_io import load_safetensors_export
    from protrain_demo.gpt import GPT
    from tests.checkpointing import checkpoint_job

    saved = root / "ckpt" / f"step-{plan.before:08d}"
    spec = checkpoint_job(str(root / "export"), **overrides, checkpoint={"resume": str(saved)})
    path = root / "export" / "model.safetensors"
    with runtime.initialize(GPT(config), config=spec) as engine:
        resumed_at = engine.global_step
        engine.export(path)
        state = to_cpu(engine.state_dict())
        persistent = engine.plan.n_persist
        num_chunks = engine.plan.num_chunks
    fresh = GPT(config)
    fresh.load_state_dict(load_safetensors_export(path), strict=True)
    differ = unequal(to_cpu(fresh.state_dict()), state)
    ctx.check(
        "under the wall: export after resume equals the engine's state",
        resumed_at == plan.before and not differ,
        f"resumed at update {resumed_at} from {saved.name}; exported {path.stat().st_size / MIB:.2f} MiB "
        f"(n_persist {persistent}/{num_chunks}), loaded into a plain GPT: "
        + ("bit-equal" if not differ else f"differs in {', '.join(differ[:3])}"),
        export_mib=round(path.stat().st_size / MIB, 3),
        tensors_differing=len(differ),
    )


SECTION = Section(
    name="checkpoint",
    title="save, exact resume and export under the strict device wall, the model larger than the wall",
    run=run,
    cpu_counterpart=(
        f"{checkpoint.SECTION.cpu_counterpart}, tests/unit/test_device_wall.py, "
        "tests/unit/test_export.py::test_export_of_an_offloaded_engine_loads_into_a_plain_model"
    ),
    record_memory=True,
)

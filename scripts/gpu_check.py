"""Checks for the day a GPU is lent: the chunk engine with real CUDA streams, pinned memory and
``torch.cuda`` memory statistics.

    python scripts/gpu_check.py            # one table; exits 0 without CUDA (and says so)

1. Equivalence: a small GPT trained 10 steps in fp32 with every chunk offloaded through the
   minimum number of buffers equals plain PyTorch (``torch.optim.AdamW(fused=True)``) within
   DESIGN's tolerance (per tensor max|a-b| <= 1e-5 max|b|).
2. Residency: every parameter a module reads lies in the buffer pool or a persistent chunk, and
   ``torch.cuda.max_memory_allocated`` stays within the plan's device budget plus the measured
   activation peak of the same model kept resident.
3. Speed: step time with everything offloaded vs everything persistent (ratio; CUDA figures).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import runtime  # noqa: E402
from runtime.data import LMBatches, stdlib_text_corpus  # noqa: E402
from runtime.models.gpt import GPT, GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, seq_len=256, n_layer=6, n_head=8, d_model=512, qkv_bias=False)


def build(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIG).cuda()


def batches(steps: int) -> list[dict[str, torch.Tensor]]:
    data = LMBatches(
        tokens=stdlib_text_corpus(),
        seq_len=CONFIG.seq_len,
        micro_batch_size=4,
        gradient_accumulation_steps=1,
        world_size=1,
        seed=1,
    )
    return [{k: v.cuda() for k, v in data.batch(step, 0, 0).items()} for step in range(steps)]


def spec(out: str, **memory: Any) -> dict[str, Any]:
    return {
        "seed": 1,
        "micro_batch_size": 4,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "memory": {"chunk_size": "4MiB", **memory},
        "output_dir": out,
    }


def check_equivalence(out: str, data: list[dict[str, torch.Tensor]]) -> tuple[bool, float]:
    reference = build()
    optimizer = torch.optim.AdamW(
        reference.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True
    )
    engine = runtime.initialize(
        build(), config=spec(out, n_persist=0, n_buffer=2) | {"optimizer": {"lr": 1e-3, "weight_decay": 0.0}}
    )
    for batch in data:
        reference(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.backward(engine(**batch).loss)
        engine.step()
    state = engine.state_dict()
    worst = max(
        ((state[k] - v).abs().max() / v.abs().max()).item() for k, v in reference.state_dict().items()
    )
    engine.close()
    return worst <= 1e-5, worst


def peak_and_time(
    out: str, data: list[dict[str, torch.Tensor]], **memory: Any
) -> tuple[int, float, int, bool]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build()
    engine = runtime.initialize(model, config=spec(out, **memory))
    pool = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in engine.chunks.slots]
    pool += [
        (c.full.data_ptr(), c.full.data_ptr() + c.full.numel() * c.full.element_size())
        for c in engine.chunks.chunks
        if c.persistent and c.full is not None
    ]
    outside: list[str] = []

    def check(module: torch.nn.Module, *_: object) -> None:
        for name, param in module.named_parameters(recurse=False):
            if not any(a <= param.data_ptr() < b for a, b in pool):
                outside.append(name)

    handles = [m.register_forward_pre_hook(check) for m in model.modules()]
    times = []
    for batch in data:
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.backward(engine(**batch).loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    for handle in handles:
        handle.remove()
    budget = engine.plan.device_budget_bytes
    engine.close()
    return torch.cuda.max_memory_allocated(), statistics.median(times[2:]), budget, not outside


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (exit 0).")
        return 0
    from rich.console import Console
    from rich.table import Table

    data = batches(10)
    with tempfile.TemporaryDirectory() as out:
        equal, worst = check_equivalence(out, data)
        resident_peak, resident_s, _, resident_ok = peak_and_time(out, data)
        offload_peak, offload_s, budget, offload_ok = peak_and_time(out, data, n_persist=0, n_buffer=2)
    table = Table(title=f"ProTrain GPU check on {torch.cuda.get_device_name()}")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    table.add_row(
        "fp32 equivalence, all offloaded", "ok" if equal else "FAIL", f"worst max|a-b|/max|b| = {worst:.2e}"
    )
    table.add_row("parameters read from the pool", "ok" if resident_ok and offload_ok else "FAIL", "")
    table.add_row("peak allocated, resident", f"{resident_peak / 2**20:.1f} MiB", "")
    table.add_row(
        "peak allocated, offloaded",
        f"{offload_peak / 2**20:.1f} MiB",
        "ok" if offload_peak < resident_peak and offload_peak <= budget else "FAIL",
    )
    table.add_row(
        "step time offloaded / resident",
        f"{offload_s / resident_s:.2f}x",
        f"{offload_s * 1000:.1f} ms vs {resident_s * 1000:.1f} ms",
    )
    Console().print(table)
    return 0 if equal and resident_ok and offload_ok and offload_peak < resident_peak else 1


if __name__ == "__main__":
    raise SystemExit(main())

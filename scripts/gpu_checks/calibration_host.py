"""The calibration stage's host measurements (calibration.py runs them): the host worker's
arithmetic, timed as the pipeline runs it, on a thread of its own with a set number of intra-op
threads (torch's OpenMP backend keeps that number per thread).

- downcast: an fp32 shard into a bf16 copy (``copy_``), what mixed precision sends to the device;
- widen-then-add: a bf16 gradient widened into an fp32 scratch, then added into the fp32 shard,
  beside the mixed-dtype ``add_`` it replaces (issue 26, item 2: 131 ms against 32 ms for 64M
  elements on the 2-core CPU machine);
- each alone at the host worker's thread count (``runtime.hw.device.host_worker_threads``: on a
  16-core GPU machine 14), alone at half of it, and at half of it while CPU Adam steps without
  pause on the other half (the memory bus is shared: the rate beside Adam is what a pipeline
  that overlaps them gets);
- CPU Adam (``runtime.optim.adamw.ShardAdamW``, one segment) at two shard sizes, at the host
  worker's thread count.

Each figure is the best of a few repeats after a warm-up (first-touch page faults excluded).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_checks.common import Context
from protrain.runtime.planning.host_rates import best_time, on_thread


@dataclass(frozen=True, slots=True)
class HostSizes:
    numel: int
    """Elements of the shard the downcast and the adds run over."""
    adam_beside_numel: int
    """The shard CPU Adam steps over while it runs beside them."""
    adam_numels: tuple[int, ...]
    repeats: int


class BackgroundAdam:
    """CPU Adam stepping without pause on its own thread (``threads`` intra-op threads) until
    stopped; its steps per second while it ran."""

    def __init__(self, numel: int, threads: int) -> None:
        from protrain.runtime.optim.adamw import ShardAdamW

        self.master = torch.zeros(numel)
        self.grad = torch.full_like(self.master, 1e-3)
        self.adam = ShardAdamW(self.master, [(0, numel, 0.1)], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        self.threads = threads
        self.stop = threading.Event()
        self.stepping = threading.Event()
        self.steps = 0
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._loop, name="calibration-adam")

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)
        self.adam.step_(self.grad, [True])  # warm-up, not counted
        self.stepping.set()
        started = time.perf_counter()
        while not self.stop.is_set():
            self.adam.step_(self.grad, [True])
            self.steps += 1
        self.seconds = time.perf_counter() - started

    def __enter__(self) -> BackgroundAdam:
        self.thread.start()
        self.stepping.wait()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()

    @property
    def params_per_s(self) -> float:
        return self.steps * self.master.numel() / self.seconds if self.seconds > 0 else 0.0


def host_rates(ctx: Context, sizes: HostSizes, worker_threads: int) -> None:
    """Downcast, widen-then-add and the mixed-dtype add: alone at the host worker's thread
    count, alone at half, and at half beside CPU Adam on the other half."""
    n = sizes.numel
    master = torch.zeros(n)
    master_bf16 = torch.empty(n, dtype=torch.bfloat16)
    grad_bf16 = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    scratch = torch.empty(n)

    def widen_then_add() -> None:
        scratch.copy_(grad_bf16)
        master.add_(scratch)

    ops: dict[str, Callable[[], object]] = {
        "downcast fp32->bf16": lambda: master_bf16.copy_(master),
        "widen-then-add bf16->fp32": widen_then_add,
        "mixed-dtype add_ (bf16 into fp32)": lambda: master.add_(grad_bf16),
    }
    half = max(1, worker_threads // 2)
    others = max(1, worker_threads - half)
    for name, op in ops.items():
        alone = on_thread(worker_threads, lambda op=op: best_time(op, sizes.repeats))
        alone_half = on_thread(half, lambda op=op: best_time(op, sizes.repeats))
        with BackgroundAdam(sizes.adam_beside_numel, others) as adam:
            beside = on_thread(half, lambda op=op: best_time(op, sizes.repeats))
        ctx.check(
            f"host {name}",
            None,
            f"{n / 2**20:.0f}Mi elements: {alone * 1e3:.2f} ms on {worker_threads} threads (the host worker's), "
            f"{alone_half * 1e3:.2f} ms on {half}, {beside * 1e3:.2f} ms on {half} beside CPU Adam on {others} "
            f"({adam.params_per_s / 1e9:.2f} G params/s meanwhile)",
            elements=n,
            ms_alone=round(alone * 1e3, 3),
            gelem_per_s_alone=round(n / alone / 1e9, 3),
            threads_alone=worker_threads,
            ms_half=round(alone_half * 1e3, 3),
            ms_beside_adam=round(beside * 1e3, 3),
            gelem_per_s_beside_adam=round(n / beside / 1e9, 3),
            threads_half=half,
            adam_threads=others,
            adam_gparams_per_s_beside=round(adam.params_per_s / 1e9, 3),
        )


def adam_rates(ctx: Context, sizes: HostSizes, worker_threads: int) -> None:
    """ShardAdamW over one fp32 shard of each size, at the host worker's thread count."""
    from protrain.runtime.optim.adamw import ShardAdamW

    for numel in sizes.adam_numels:

        def measure(numel: int = numel) -> float:
            master = torch.zeros(numel)
            grad = torch.full_like(master, 1e-3)
            adam = ShardAdamW(master, [(0, numel, 0.1)], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
            return best_time(lambda: adam.step_(grad, [True]), sizes.repeats)

        seconds = on_thread(worker_threads, measure)
        ctx.check(
            f"CPU Adam, {numel / 2**20:g}Mi parameters",
            None,
            f"ShardAdamW, one segment, {worker_threads} threads: {seconds * 1e3:.1f} ms per step, "
            f"{numel / seconds / 1e9:.3f} G params/s",
            params=numel,
            threads=worker_threads,
            ms_per_step=round(seconds * 1e3, 3),
            gparams_per_s=round(numel / seconds / 1e9, 4),
        )

"""Time the chunk engine's CPU AdamW against torch's and DeepSpeed's on the same parameters.

    .venv/bin/python scripts/bench_adam.py            # 100M fp32 parameters
    .venv/bin/python scripts/bench_adam.py --smoke    # one step on 1M parameters

Candidates, each in fp32 and with the bf16 copy-out mixed precision needs (the updated master
converted into the compute copy sent back to the device): ours (``runtime.optim.adamw.ShardAdamW``
over one flat shard), ``torch.optim.AdamW(foreach=True)`` and ``torch.optim.AdamW(fused=True)``
over separate parameters of the same sizes, and ``DeepSpeedCPUAdam`` when ``import deepspeed``
works (never installed or required here). The parameter sizes are those of GPT-style blocks of
width 1024, decay on matrices and none on biases and norms. Candidates run interleaved, in a
rotating order, and each repeat is timed over ``--steps`` steps: the table gives the median over
repeats and their range. Memory-bandwidth probes (in-place ``add_``, ``copy_`` and ``addcmul_``
on tensors of ``--bandwidth-gib``) run in the same rotation. The share of the highest probe that
each optimizer reaches counts 28 bytes per parameter per step (fp32 AdamW reads param, grad,
exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq), also for the copy-out rows, whose
extra traffic is thus not counted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from protrain.runtime.optim.adamw import ShardAdamW

BYTES_PER_PARAM = 28
LR = 1e-3
WEIGHT_DECAY = 0.1
WIDTH = 1024
# One GPT block of width 1024: (numel, decays) for ln_1, qkv, proj, ln_2, fc, fc_proj.
BLOCK = (
    (WIDTH, False), (WIDTH, False),
    (3 * WIDTH * WIDTH, True), (3 * WIDTH, False),
    (WIDTH * WIDTH, True), (WIDTH, False),
    (WIDTH, False), (WIDTH, False),
    (4 * WIDTH * WIDTH, True), (4 * WIDTH, False),
    (4 * WIDTH * WIDTH, True), (WIDTH, False),
)  # fmt: skip


@dataclass
class Timings:
    """Seconds per step of one candidate, one entry per repeat."""

    name: str
    mode: str
    step: Callable[[], None]
    seconds: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=int, default=100_000_000, help="fp32 parameters in all")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats per candidate")
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the bandwidth probe")
    parser.add_argument("--smoke", action="store_true", help="one step on 1M parameters (a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.params, args.steps, args.repeats, args.bandwidth_gib = 1_000_000, 1, 1, 1 / 16
    if args.params < 1 or args.steps < 1 or args.repeats < 1 or args.bandwidth_gib <= 0:
        parser.error("--params, --steps, --repeats and --bandwidth-gib must be positive")
    return args


def layer_sizes(num_params: int) -> list[tuple[int, bool]]:
    """(numel, decay) per parameter: whole GPT blocks, the last one cut at ``num_params``."""
    sizes: list[tuple[int, bool]] = []
    total = 0
    while total < num_params:
        for numel, decay in BLOCK:
            take = min(numel, num_params - total)
            if take == 0:
                break
            sizes.append((take, decay))
            total += take
    return sizes


def flat_views(flat: torch.Tensor, sizes: Sequence[tuple[int, bool]]) -> list[torch.Tensor]:
    return list(flat.split_with_sizes([numel for numel, _ in sizes]))


def ours(sizes: list[tuple[int, bool]], grad: torch.Tensor, copy: torch.Tensor) -> list[Timings]:
    master = torch.randn(grad.numel())
    segments: list[tuple[int, int, float]] = []
    start = 0
    for numel, decay in sizes:  # back to back, as parameters lie in a chunk
        segments.append((start, numel, WEIGHT_DECAY if decay else 0.0))
        start += numel
    shard = ShardAdamW(master, segments, lr=LR)
    active = [True] * len(segments)
    return [
        Timings("ours (ShardAdamW)", "fp32", lambda: shard.step_(grad, active)),
        Timings("ours (ShardAdamW)", "+bf16 copy", lambda: shard.step_(grad, active, copy_out=copy)),
    ]


def separate_params(sizes: list[tuple[int, bool]], grad: torch.Tensor) -> list[nn.Parameter]:
    """Ordinary parameters of the same sizes, their grads views of the shared gradient."""
    params = [nn.Parameter(torch.randn(numel)) for numel, _ in sizes]
    for param, view in zip(params, flat_views(grad, sizes), strict=False):
        param.grad = view
    return params


def decay_groups(params: list[nn.Parameter], sizes: list[tuple[int, bool]]) -> list[dict[str, object]]:
    decay = [p for p, (_, has_decay) in zip(params, sizes, strict=False) if has_decay]
    no_decay = [p for p, (_, has_decay) in zip(params, sizes, strict=False) if not has_decay]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def with_copy(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], copies: list[torch.Tensor]
) -> Callable[[], None]:
    """The step, then each parameter converted into its compute copy (one foreach call)."""

    def step() -> None:
        optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(copies, params)

    return step


def torch_adamw(
    sizes: list[tuple[int, bool]], grad: torch.Tensor, copy: torch.Tensor, kind: str
) -> list[Timings]:
    params = separate_params(sizes, grad)
    optimizer = torch.optim.AdamW(decay_groups(params, sizes), lr=LR, **{kind: True})
    name = f"torch AdamW({kind}=True)"
    return [
        Timings(name, "fp32", optimizer.step),
        Timings(name, "+bf16 copy", with_copy(optimizer, params, flat_views(copy, sizes))),
    ]


def deepspeed_adam(sizes: list[tuple[int, bool]], grad: torch.Tensor, copy: torch.Tensor) -> list[Timings]:
    """DeepSpeedCPUAdam when deepspeed imports; its C++ op may still fail to build (reported)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # optional, never a dependency
    except Exception:  # any failure to import deepspeed means: not available here
        print("DeepSpeedCPUAdam: not installed")
        return []
    try:
        params = separate_params(sizes, grad)
        optimizer = DeepSpeedCPUAdam(decay_groups(params, sizes), lr=LR, adamw_mode=True)
        optimizer.step()
    except Exception as error:  # report why and keep the other rows
        print(f"DeepSpeedCPUAdam: unavailable ({type(error).__name__}: {error})")
        return []
    return [
        Timings("DeepSpeedCPUAdam", "fp32", optimizer.step),
        Timings("DeepSpeedCPUAdam", "+bf16 copy", with_copy(optimizer, params, flat_views(copy, sizes))),
    ]


@dataclass
class Probe:
    """A streaming torch op whose bytes read plus written are known: ``passes`` x tensor size."""

    timings: Timings
    passes: int

    def gbs(self, tensor_bytes: int) -> float:
        return self.passes * tensor_bytes / self.timings.median_s / 1e9


def bandwidth_probes(gib: float) -> tuple[list[Probe], int]:
    numel = int(gib * 2**30) // 4
    a = torch.full((numel,), 1.0)
    b = torch.full((numel,), 1e-3)
    c = torch.full((numel,), 1.0)
    probes = [
        Probe(Timings("add_", "probe", lambda: a.add_(b)), passes=3),  # read a, b; write a
        Probe(Timings("copy_", "probe", lambda: a.copy_(b)), passes=2),  # read b; write a
        Probe(Timings("addcmul_", "probe", lambda: a.addcmul_(b, c, value=1e-3)), passes=4),
    ]
    return probes, numel * 4


def run(timings: list[Timings], *, steps: int, repeats: int) -> None:
    """Each repeat times every candidate once over ``steps`` calls, the order rotating so that
    none always runs first (or right after the same neighbour)."""
    for candidate in timings:  # warm-up: torch creates its optimizer state on the first step
        candidate.step()
    for repeat in range(repeats):
        shift = repeat % len(timings)
        for candidate in timings[shift:] + timings[:shift]:
            start = time.perf_counter()
            for _ in range(steps):
                candidate.step()
            candidate.seconds.append((time.perf_counter() - start) / steps)


def print_table(results: list[Timings], *, num_params: int, bandwidth_gbs: float) -> None:
    baseline = {t.mode: t.median_s for t in results if "foreach" in t.name}
    deepspeed = {t.mode: t.median_s for t in results if t.name == "DeepSpeedCPUAdam"}
    header = (
        f"{'optimizer':<26}{'mode':<12}{'s/step':>9}{'range (s)':>17}{'Gparam/s':>10}"
        f"{'vs foreach':>12}{'vs DeepSpeed':>14}{'BW share':>10}"
    )
    print(header)
    print("-" * len(header))
    for t in results:
        median = t.median_s
        versus_ds = f"{deepspeed[t.mode] / median:.2f}x" if t.mode in deepspeed else "-"
        share = BYTES_PER_PARAM * num_params / median / 1e9 / bandwidth_gbs
        print(
            f"{t.name:<26}{t.mode:<12}{median:>9.4f}{f'{min(t.seconds):.4f}-{max(t.seconds):.4f}':>17}"
            f"{num_params / median / 1e9:>10.3f}{f'{baseline[t.mode] / median:.2f}x':>12}{versus_ds:>14}"
            f"{share:>10.0%}"
        )
    print(
        "vs foreach / vs DeepSpeed: their s/step divided by this row's (above 1 = faster).\n"
        f"BW share: {BYTES_PER_PARAM} B/param/step over the reference bandwidth (copy-out traffic not "
        "counted); above 100% means AdamW's 7 streams draw more than the simple probes can."
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    sizes = layer_sizes(args.params)
    grad = torch.randn(args.params) * 1e-2
    copy = torch.empty(args.params, dtype=torch.bfloat16)
    candidates = ours(sizes, grad, copy)
    candidates += torch_adamw(sizes, grad, copy, "foreach") + torch_adamw(sizes, grad, copy, "fused")
    candidates += deepspeed_adam(sizes, grad, copy)
    probes, probe_bytes = bandwidth_probes(args.bandwidth_gib)
    run(candidates + [probe.timings for probe in probes], steps=args.steps, repeats=args.repeats)
    bandwidth_gbs = max(probe.gbs(probe_bytes) for probe in probes)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}; {args.params:,} parameters in {len(sizes)} tensors; "
        f"{args.steps} steps x {args.repeats} interleaved repeats"
    )
    print(
        f"memory bandwidth, tensors of {probe_bytes / 2**30:.2f} GiB, bytes read + written: "
        + ", ".join(f"{p.timings.name} {p.gbs(probe_bytes):.1f} GB/s" for p in probes)
        + f"; reference = the highest, {bandwidth_gbs:.1f} GB/s"
    )
    print_table(candidates, num_params=args.params, bandwidth_gbs=bandwidth_gbs)


if __name__ == "__main__":
    main()

"""Time each optimizer rule's shard kernel against torch's own implementation of the same update.

    .venv/bin/python scripts/bench_optimizers.py            # 25M fp32 parameters
    .venv/bin/python scripts/bench_optimizers.py --smoke    # one step on 1M parameters
    .venv/bin/python scripts/bench_optimizers.py --device cuda   # the device path on a GPU

Rules: adamw, adam, lion, sgd with momentum 0.9, sgd without. For each, ours (the rule's kernel
over one flat shard holding GPT blocks of width 1024, as a chunk does) runs beside torch's
optimizer over separate parameters of the same sizes: ``torch.optim.AdamW``/``Adam`` fused and
foreach, ``torch.optim.SGD`` for-loop, foreach and fused, and for Lion the ``lion-pytorch``
package where it imports (else the published rule written over each parameter). Two paths:

- host: offloaded chunks, updated on the host worker's threads (``host_worker_threads``), the
  references given the same thread count;
- device: persistent chunks on ``--device`` (on CPU: the same memory at every thread; on CUDA
  the kernels run as multi-tensor ones).

Candidates run interleaved in a rotating order; the table gives the median over repeats and the
ratio against the reference named in it (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
from bench_adam import Timings, decay_groups, layer_sizes, run, separate_params

from protrain.runtime.hw.device import DeviceInfo, host_worker_threads
from protrain.runtime.optim.registry import rule_named
from protrain.runtime.optim.rule import OptimizerHyper

LR, WEIGHT_DECAY, BETAS = 1e-3, 0.1, (0.9, 0.99)
RULES: dict[str, dict[str, Any]] = {
    "adamw": {},
    "adam": {},
    "lion": {},
    "sgd+momentum": {"momentum": 0.9},
    "sgd": {},
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=25_000_000, help="fp32 parameters in all")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats per candidate")
    parser.add_argument("--device", default="cpu", help="the device path's device (cpu or cuda)")
    parser.add_argument("--smoke", action="store_true", help="one step on 1M parameters (a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.params, args.steps, args.repeats = 1_000_000, 1, 1
    if args.params < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--params, --steps and --repeats must be positive")
    return args


def rule_of(label: str) -> tuple[str, dict[str, Any]]:
    return label.split("+")[0], RULES[label]


def ours(label: str, sizes: list[tuple[int, bool]], grad: torch.Tensor) -> Callable[[], None]:
    name, sgd = rule_of(label)
    rule = rule_named(name).for_momentum(sgd.get("momentum", 0.0))
    master = torch.randn(grad.numel(), device=grad.device)
    segments, start = [], 0
    for numel, decay in sizes:  # back to back, as parameters lie in a chunk
        segments.append((start, numel, WEIGHT_DECAY if decay else 0.0, 0))
        start += numel
    hyper = OptimizerHyper(weight_decay=(), group=(), lrs=(LR,), betas=(BETAS,), eps=1e-8, **sgd)
    states = tuple(torch.zeros_like(master) for _ in rule.state_names)
    kernel = rule.build(master, segments, hyper=hyper, states=states)
    active = [True] * len(segments)
    return lambda: kernel.step_(grad, active)


def references(label: str, sizes: list[tuple[int, bool]], grad: torch.Tensor) -> list[tuple[str, Callable[[], Any]]]:
    """torch's implementations of the rule over separate parameters (grads: views of ``grad``)."""
    name, sgd = rule_of(label)
    cuda = grad.is_cuda

    def groups() -> list[dict[str, object]]:
        params = separate_params(sizes, grad.cpu())
        if cuda:
            params = [torch.nn.Parameter(p.detach().to(grad.device)) for p in params]
            for param, view in zip(params, grad.split_with_sizes([n for n, _ in sizes]), strict=True):
                param.grad = view
        return decay_groups(params, sizes)

    if name in ("adamw", "adam"):
        kind = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return [
            (f"torch {kind.__name__}(fused)", kind(groups(), lr=LR, betas=BETAS, fused=True).step),
            (f"torch {kind.__name__}(foreach)", kind(groups(), lr=LR, betas=BETAS, foreach=True).step),
        ]
    if name == "sgd":
        return [
            (f"torch SGD({variant})", torch.optim.SGD(groups(), lr=LR, **sgd, **{variant: True}).step)
            for variant in ("fused", "foreach")
        ] + [("torch SGD(for-loop)", torch.optim.SGD(groups(), lr=LR, foreach=False, **sgd).step)]
    try:
        from lion_pytorch import Lion
    except ImportError:
        print("lion-pytorch: not installed; Lion has no torch reference here")
        return []
    return [("lion-pytorch", Lion(groups(), lr=LR, betas=BETAS).step)]


def candidates(path: str, device: torch.device, sizes: list[tuple[int, bool]]) -> list[tuple[str, Timings]]:
    grad = (torch.randn(sum(n for n, _ in sizes)) * 1e-2).to(device)
    found = []
    for label in RULES:
        found.append((label, Timings(f"ours ({label})", path, ours(label, sizes, grad))))
        found += [(label, Timings(name, path, step)) for name, step in references(label, sizes, grad)]
    return found


def synchronized(step: Callable[[], Any]) -> Callable[[], None]:
    """``step``, then a wait for the device (a CUDA kernel returns before it has run)."""

    def call() -> None:
        step()
        torch.cuda.synchronize()

    return call


def timed(
    path: str, device: torch.device, sizes: list[tuple[int, bool]], args: argparse.Namespace
) -> list[tuple[str, Timings]]:
    found = candidates(path, device, sizes)
    if device.type == "cuda":
        for _, candidate in found:
            candidate.step = synchronized(candidate.step)
    run([t for _, t in found], steps=args.steps, repeats=args.repeats)
    return found


def print_table(rows: list[tuple[str, Timings]], num_params: int) -> None:
    header = f"{'rule':<14}{'path':<8}{'implementation':<24}{'s/step':>9}{'Gparam/s':>10}{'ours vs it':>12}"
    print(header)
    print("-" * len(header))
    ours_s = {(label, t.mode): t.median_s for label, t in rows if t.name.startswith("ours")}
    for label, t in rows:
        ratio = "" if t.name.startswith("ours") else f"{t.median_s / ours_s[label, t.mode]:.2f}x"
        print(f"{label:<14}{t.mode:<8}{t.name:<24}{t.median_s:>9.4f}{num_params / t.median_s / 1e9:>10.3f}{ratio:>12}")
    print("ours vs it: its s/step over ours (above 1: ours is faster).")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    sizes = layer_sizes(args.params)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    host_threads = host_worker_threads(DeviceInfo(device, "nccl" if device.type == "cuda" else "gloo"))
    torch.set_num_threads(host_threads)
    rows = timed("host", torch.device("cpu"), sizes, args)
    torch.set_num_threads(threads)
    rows += timed("device", device, sizes, args)
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}; host path on {host_threads} "
        f"thread(s), device path on {device} ({threads} threads); {args.params:,} parameters in "
        f"{len(sizes)} tensors; {args.steps} steps x {args.repeats} interleaved repeats"
    )
    print_table(rows, args.params)


if __name__ == "__main__":
    main()

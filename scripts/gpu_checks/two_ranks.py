"""Section ``two_ranks``: two processes train one model together on the one GPU, over gloo.

NCCL refuses two ranks on one device, so each rank makes a gloo process group itself before
``runtime.initialize``, which then reuses it (``init_distributed``) and makes the engine's own
group with the default backend: the section checks that the engine's group is gloo and that its
collective device (``DistContext.collective_device``) is the GPU, so host tensors are staged
there and gloo runs on CUDA tensors.

1. Probe: which of broadcast, reduce, all-reduce, all-gather, all-gather-into-tensor and
   reduce-scatter-tensor run over gloo on tensors of the device, with the right values (torch
   documents only broadcast and all-reduce for gloo on CUDA). The runtime's gloo path needs only
   those two there: its all-gather is one broadcast per rank, and its reduce-scatter of a CUDA
   tensor is one all-reduce (``runtime.hw.distributed.reduce_scatter_by_all_reduce_``; host
   tensors keep one reduce per rank). A check that they ran; the rest are figures.
2. The runtime's flat collectives on the device (fp32 and bf16), against sums computed locally
   from both ranks' seeded inputs; the all-reduce reduce-scatter is run on the CPU too, so the
   rehearsal covers the CUDA path's code.
3. Training, correctness only, with an explicit per-rank ``memory.device_budget`` (4 GiB; 512
   MiB in the rehearsal), rank 1 starting from other weights (``initialize`` must broadcast rank
   0's): 2 chunks persistent and the rest offloaded, with 2 accumulation steps; and every chunk
   offloaded with swapped and checkpointed blocks and clipping. Both ranks must end bit-equal,
   and equal plain PyTorch on the same device trained on both ranks' batches (``train_reference``
   with world size 2 averages per-rank gradients) by DESIGN section 6's oracle; the ranks' mean
   loss within 1e-5 of the reference's at every update (test_engine_two_ranks.py's bound).

The ranks are spawned (``torch.multiprocessing``, a port from the OS), each writes its results
to a file; a rank that fails or hangs past the deadline fails the section with its traceback.
Expected time on one H100: under a minute (two processes start, 10 updates per case); the
rehearsal on 2 CPU ranks with one thread each 10-15 s.

CPU counterparts: tests/distributed/test_engine_two_ranks.py (two ranks equal plain PyTorch) and
tests/distributed/test_collectives_two_ranks.py (the gloo flat collectives equal torch's).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from gpu_checks.common import Context, Section

WORLD = 2
CLIP = 0.05
DEADLINE_S = 300
PROBES = (
    "broadcast",
    "reduce",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)
NEEDED = ("broadcast", "all_reduce")
"""What the runtime's gloo path issues on CUDA tensors."""


def run(ctx: Context) -> None:
    from gpu_checks import training

    size = training.sizes(ctx)
    budget = 512 * 2**20 if ctx.rehearsal else 4 * 2**30
    chunk = training.chunk_bytes(_model(size, 0), element_size=4, min_chunks=8)
    cases = {
        "2 chunks persistent, the rest offloaded, 2 accumulation steps": {
            "accumulation": 2,
            "clip": 0.0,
            "memory": {"chunk_size": chunk, "n_persist": 2, "n_buffer": 2, "block_modes": ["keep"] * 4},
        },
        "every chunk offloaded, no clipping or accumulation (gradients applied as they arrive)": {
            "accumulation": 1,
            "clip": 0.0,
            "memory": {"chunk_size": chunk, "n_persist": 0, "n_buffer": 2, "block_modes": ["keep"] * 4},
        },
        f"every chunk offloaded, blocks swap/checkpoint, clip {CLIP}": {
            "accumulation": 1,
            "clip": CLIP,
            "memory": {
                "chunk_size": chunk,
                "n_persist": 0,
                "n_buffer": 2,
                "block_modes": ["swap", "checkpoint", "keep", "keep"],
            },
        },
    }
    job = {
        "cuda": ctx.is_cuda,
        "gpu": (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0],
        "threads": 1 if ctx.rehearsal else 4,
        "port": _free_port(),
        "model": asdict(size.model),
        "micro_batch": size.micro_batch,
        "steps": size.steps,
        "budget": budget,
        "cases": cases,
        "out": str(ctx.scratch),
    }
    results = _spawn(job)
    device = "cuda" if ctx.is_cuda else "cpu"
    _report_probe(ctx, results, device)
    mismatches = sorted({m for r in results for m in r["collectives"]})
    ctx.check(
        f"the runtime's gloo collectives on {device} tensors",
        not mismatches,
        "all_gather_flat (a broadcast per rank), reduce_scatter_flat_ and reduce_scatter_by_all_reduce_, "
        "fp32 and bf16, equal sums computed locally"
        + (f"; wrong: {', '.join(mismatches)}" if mismatches else ""),
    )
    for name, case in cases.items():
        _judge_case(ctx, size, name, case, [r["cases"][name] for r in results], budget)


def _model(size: Any, seed: int) -> torch.nn.Module:
    from protrain_demo.gpt import GPT

    torch.manual_seed(seed)
    return GPT(size.model)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Run both ranks; their results, or RuntimeError with the failing rank's traceback."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    ranks = [context.Process(target=_rank_main, args=(rank, job), daemon=True) for rank in range(WORLD)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + DEADLINE_S
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
    for rank in hung:
        ranks[rank].kill()
        ranks[rank].join()
    results = []
    for rank in range(WORLD):
        path = Path(job["out"]) / f"rank{rank}.pt"
        result = torch.load(path, weights_only=False) if path.exists() else {"error": "wrote no result"}
        if rank in hung:
            result = {"error": f"still running after {DEADLINE_S} s (stuck in a collective?)"}
        if "error" in result:
            raise RuntimeError(f"rank {rank}: {result['error']}")
        results.append(result)
    return results


def _rank_main(rank: int, job: dict[str, Any]) -> None:
    """One rank: the probe, the runtime's collectives, the training cases; results to a file."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job["port"]),
    )
    if job["cuda"]:
        # Both ranks on the one GPU the parent uses (LOCAL_RANK would pick GPU 1 if there were two).
        os.environ["CUDA_VISIBLE_DEVICES"] = job["gpu"]
    result: dict[str, Any] = {}
    try:
        import torch.distributed as dist

        torch.set_num_threads(job["threads"])
        device = torch.device("cuda", 0) if job["cuda"] else torch.device("cpu")
        if job["cuda"]:
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        result["probe"] = _probe(device, rank)
        result["collectives"] = _runtime_collectives(device, rank)
        result["cases"] = {name: _train_case(job, case, rank) for name, case in job["cases"].items()}
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        result["error"] = traceback.format_exc()[-4000:]
    torch.save(result, Path(job["out"]) / f"rank{rank}.pt")


def _probe(device: torch.device, rank: int) -> dict[str, str]:
    """Each collective on tensors of ``device``: "ran, correct", "ran, wrong" or why refused."""
    import torch.distributed as dist

    base = torch.arange(8, dtype=torch.float32)
    mine = (base + 100 * rank).to(device)
    total = 2 * base + 100
    both = torch.cat([base, base + 100])

    def broadcast() -> tuple[torch.Tensor, torch.Tensor]:
        tensor = mine.clone()
        dist.broadcast(tensor, src=1)
        return tensor, base + 100

    def reduce() -> tuple[torch.Tensor, torch.Tensor]:
        tensor = mine.clone()
        dist.reduce(tensor, dst=0)
        return (tensor, total) if rank == 0 else (tensor, tensor.cpu())  # only the root's is defined

    def all_reduce() -> tuple[torch.Tensor, torch.Tensor]:
        tensor = mine.clone()
        dist.all_reduce(tensor)
        return tensor, total

    def all_gather() -> tuple[torch.Tensor, torch.Tensor]:
        parts = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(parts, mine)
        return torch.cat(parts), both

    def all_gather_into_tensor() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(WORLD * mine.numel(), dtype=mine.dtype, device=device)
        dist.all_gather_into_tensor(out, mine)
        return out, both

    def reduce_scatter_tensor() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(4, dtype=mine.dtype, device=device)
        dist.reduce_scatter_tensor(out, mine.clone())
        return out, total[rank * 4 :][:4]

    results = {}
    for name, attempt in zip(
        PROBES,
        (broadcast, reduce, all_reduce, all_gather, all_gather_into_tensor, reduce_scatter_tensor),
        strict=True,
    ):
        try:
            got, expected = attempt()
            results[name] = "ran, correct" if torch.equal(got.cpu(), expected) else "ran, WRONG values"
        except Exception as error:  # refused: the same argument check fails on every rank
            results[name] = f"refused: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return results


def _runtime_collectives(device: torch.device, rank: int) -> list[str]:
    """The runtime's flat collectives on ``device``; every case whose result is wrong."""
    from protrain.runtime.hw.distributed import all_gather_flat, reduce_scatter_by_all_reduce_, reduce_scatter_flat_

    wrong = []
    for numel in (3, 1 << 16):
        for dtype in (torch.float32, torch.bfloat16):
            inputs = [
                torch.randn(WORLD * numel, generator=torch.Generator().manual_seed(1000 * r + numel)).to(
                    dtype
                )
                for r in range(WORLD)
            ]
            total = (inputs[0] + inputs[1])[rank * numel :][:numel]  # two ranks: a + b either way
            full = torch.full((WORLD * numel,), float("nan"), dtype=dtype, device=device)
            shard = inputs[rank][rank * numel :][:numel].to(device)
            all_gather_flat(full, shard)
            gathered = torch.cat([inputs[r][r * numel :][:numel] for r in range(WORLD)])
            if not torch.equal(full.cpu(), gathered):
                wrong.append(f"all_gather_flat {numel} {dtype}")
            for reduce in (reduce_scatter_flat_, reduce_scatter_by_all_reduce_):
                if not torch.equal(reduce(inputs[rank].to(device, copy=True)).cpu(), total):
                    wrong.append(f"{reduce.__name__} {numel} {dtype}")
    return wrong


def _train_case(job: dict[str, Any], case: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from gpu_checks import training
    from protrain import runtime
    from protrain_demo.gpt import GPTConfig

    size = training.Sizes(model=GPTConfig(**job["model"]), micro_batch=job["micro_batch"], steps=job["steps"])
    out = Path(job["out"]) / f"case-{list(job['cases'].values()).index(case)}"
    memory = {**case["memory"], "device_budget": job["budget"]}
    spec = training.engine_spec(
        out,
        micro_batch=size.micro_batch,
        memory=memory,
        gradient_accumulation_steps=case["accumulation"],
        gradient_clipping=case["clip"],
    )
    data = training.lm_data(size, accumulation=case["accumulation"], world_size=WORLD)
    # Rank 1 starts from other weights: initialize must give every rank rank 0's.
    with runtime.initialize(_model(size, rank), config=spec) as engine:
        ctx = engine.dist_ctx
        facts = {
            "backend": str(dist.get_backend(ctx.group)),
            "collective_device": str(ctx.collective_device),
            "device": str(engine.device),
            "budget": engine.plan.device_budget_bytes,
            "plan": f"{engine.plan.n_persist} of {engine.plan.num_chunks} chunks persistent, "
            f"{engine.plan.n_buffer} buffers, blocks {'/'.join(m.value for m in engine.plan.block_modes)}",
        }
        losses = training.train(engine, data, size.steps, rank=rank)
        state = training.to_cpu(engine.state_dict())
    return {"facts": facts, "losses": losses, "state": state}


def _report_probe(ctx: Context, results: list[dict[str, Any]], device: str) -> None:
    probe = results[0]["probe"]
    needed_ok = all(r["probe"][name] == "ran, correct" for r in results for name in NEEDED)
    ctx.check(
        f"gloo on {device} tensors: what ran",
        needed_ok,
        "; ".join(f"{name}: {probe[name]}" for name in PROBES)
        + f" (the runtime needs {' and '.join(NEEDED)} there)",
        **{name: probe[name] for name in PROBES},
    )


def _judge_case(
    ctx: Context, size: Any, name: str, case: dict[str, Any], ranks: list[dict[str, Any]], budget: int
) -> None:
    from gpu_checks import training
    from tests.helpers import reference_mismatches, train_reference, train_reference_float64

    facts = [r["facts"] for r in ranks]
    gloo = all(
        f["backend"] == "gloo"
        and f["collective_device"] == f["device"]
        and torch.device(f["device"]).type == ctx.device.type
        for f in facts
    )
    budgets = [f["budget"] for f in facts]
    ctx.check(
        f"{name}: the engine's group and budgets",
        gloo and budgets == [budget] * WORLD,
        f"engine group backend {facts[0]['backend']}, collective device {facts[0]['collective_device']} "
        f"(compute on {facts[0]['device']}); per-rank device budgets {budgets} (set by hand: {budget}); "
        f"{facts[0]['plan']}",
        backend=facts[0]["backend"],
        collective_device=facts[0]["collective_device"],
        budget_bytes=budgets[0],
    )
    data = training.on_device(
        training.lm_data(size, accumulation=case["accumulation"], world_size=WORLD), ctx.device
    )
    training_args = {"steps": size.steps, "lr": 1e-3, "weight_decay": 0.1, "clip": case["clip"]}
    fp32, losses = train_reference(_model(size, 0).to(ctx.device), data, **training_args)
    fp64 = train_reference_float64(_model(size, 0).to(ctx.device), data, **training_args)
    differ = training.unequal(ranks[1]["state"], ranks[0]["state"])
    refused = reference_mismatches(ranks[0]["state"], training.to_cpu(fp32), training.to_cpu(fp64))
    means = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    gap = max(abs(m - r) / abs(r) for m, r in zip(means, losses, strict=True))
    ctx.check(
        f"{name}: both ranks equal plain PyTorch",
        not differ and not refused and gap <= 1e-5,
        f"{size.steps} updates; ranks bit-equal: {not differ}; rank 0 vs plain PyTorch with both ranks' "
        f"batches, DESIGN section 6's oracle: {'pass' if not refused else refused[0]}; mean loss within "
        f"{gap:.1e} of the reference's (<= 1e-5)" + (f"; ranks differ in {differ[:3]}" if differ else ""),
        worst_relative=training.worst_relative(ranks[0]["state"], training.to_cpu(fp32)),
        loss_gap=gap,
        refused=len(refused),
    )


SECTION = Section(
    name="two_ranks",
    title="two ranks on the one GPU over gloo: collectives probed, training equals plain PyTorch",
    run=run,
    cpu_counterpart=(
        "tests/distributed/test_engine_two_ranks.py::test_two_ranks_match_plain_pytorch, "
        "tests/distributed/test_collectives_two_ranks.py::test_gloo_flat_collectives_equal_torchs"
    ),
)

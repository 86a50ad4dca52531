"""ProTrain with all optimizer state offloaded vs its peers on 2 CPU ranks: DDP, FSDP2 with CPU
offload, and DeepSpeed ZeRO-3 with the optimizer offloaded (when installed). Step time and peak
memory per rank, with ratios against DDP and FSDP2 measured in the same run.

    .venv/bin/python scripts/bench_peers.py            # GPT 6 x 512 (~19M params), 4 x 256 tokens per rank
    .venv/bin/python scripts/bench_peers.py --smoke    # one tiny step of each (a test)

Candidates (all fp32, AdamW lr 1e-3 with torch's other defaults applied to every parameter, no
clipping, constant learning rate; all start from the same weights and every rank trains on its
own share of the same batches, so their final losses should agree, all but the first):

- PyTorch alone: each rank trains its own copy with ``torch.optim.AdamW(fused=True)`` and no
  collectives at all. Not a peer but the floor: the compute and update every candidate pays, on
  cores shared with the other rank; no distributed scheme can step faster. Its loss is rank 0's
  copy's, trained on rank 0's share only;
- DDP: ``DistributedDataParallel`` (default buckets) + ``torch.optim.AdamW(fused=True)``;
- FSDP2: ``fully_shard`` on every transformer block and the root, ``CPUOffloadPolicy(pin_memory=
  False)``, + ``torch.optim.AdamW(fused=True)`` over the sharded DTensor parameters;
- DeepSpeed ZeRO-3 with ``offload_optimizer: cpu``: only if ``deepspeed`` is importable (never
  installed for this; the row says "not installed" otherwise);
- ProTrain with ``n_persist=0`` (every chunk's fp32 master, gradient and Adam state in the host
  tier) at the chunk size the planner picks for ``n_persist=0`` (``--chunk-size auto``, planned
  once by a pair of ranks; or the size given), with the fewest ``n_buffer`` that
  ``runtime.initialize`` accepts, with one more, and with one buffer per chunk: each chunk is
  then gathered once per step (forward's copies serve backward), so the collectives move what
  DDP's all-reduce moves (an all-gather and a reduce-scatter) instead of a second all-gather in
  backward, while the optimizer state and its update stay sharded and in the host tier;
- ProTrain auto: every memory knob but the budget (and ``--chunk-size`` when given) left to the
  planner, which may keep chunks on the device and replicate them (``n_replicate``: all-reduced
  gradients, as DDP; issue 29's target: at most 1.02x DDP's step time).

How it is measured (two separate phases, so that neither disturbs the other):

- Step time: a pair of rank processes (gloo on 127.0.0.1, one intra-op thread per rank) builds
  the peers (alone, DDP, FSDP2, DeepSpeed), gives each ``--warmup`` untimed steps, then every
  repeat times ``--steps`` steps of each, the candidates interleaved and their order alternating so
  drift of the machine hits all alike. Each ProTrain candidate is timed the same way in a pair of
  its own, beside a DDP of its own: engines left alive in one process (their worker threads,
  arenas and caches) slowed the ones timed after them, by up to a third. A step is forward +
  backward + optimizer update (synchronous on CPU); a barrier precedes each timed run and its
  time is the slower rank's. The table gives the median over repeats of seconds per step, its
  range, and the ratios of the medians: a ProTrain row's "vs DDP" against the DDP of its pair,
  its "vs FSDP2" through that DDP (its ratio to DDP times the peers' DDP-to-FSDP2 ratio).
- Memory per rank: each candidate again, alone, in a fresh pair of processes (``ru_maxrss`` and
  ``VmHWM`` only ever grow, so candidates sharing a process would hide each other). A rank records
  its ``VmRSS`` after imports, process group and batches (the baseline), builds the model and the
  candidate and takes ``--warmup`` steps, then ``--memory-steps`` more. Figures are growth over the
  baseline, the larger of the two ranks:
  "peak" is ``VmHWM`` over the whole run (model construction: every candidate builds the full model
  on every rank first; wrapping or chunking; ProTrain's profiling steps; optimizer state;
  activations), the figure the target uses; "live" is ``VmRSS`` after the warm-up once glibc has
  returned freed pages (``malloc_trim``), what the candidate holds between steps; "steps" is
  ``VmHWM`` over the later steps, after resetting the mark (``echo 5 > /proc/self/clear_refs``;
  "n/a" where not permitted). The resident set is everything the process touched: on CPU the
  "device" and "host" tiers are the same RAM, so offloading moves state without shrinking it.
  Linux only (``/proc/self/status``). For the all-offloaded plans, the peak's parts: the host
  arena, the device tier's chunk buffers, and the rest.
- Profiles: ProTrain profiles the model on its first run and caches the profile. Every ProTrain
  memory run gets an empty ``profiler.cache_dir`` of its own, so its peak includes profiling, as a
  user's first run does (a cache warmed by the timing phase would hide it); the footnote says how
  many memory runs profiled. The timing phase has its own empty cache too (never ``~/.cache``).
- Rank processes come from a fork server that has imported torch and the runtime once (torch's
  ``multiprocessing``, "forkserver" start method): each fresh pair is a fork of a clean process with
  no threads and no process group, instead of two interpreters importing torch again.

These are CPU figures: on a machine without CUDA the device is host RAM, a transfer is a memcpy on
the same cores and memory bus as compute (ProTrain's side stream and CPU-Adam thread compete with
the rank's compute thread for the 2 cores), and FSDP2's CPU offload is a copy between two CPU
tensors. They say what each system's scheduling costs here, not what a GPU would see.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import io
import os
import queue
import re
import socket
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_common import SEED, Batch, add_model_arguments, build_gpt, gpt_config

WORLD_SIZE = 2
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
TARGET_VS_FSDP2 = 0.8
PROCESS_GROUP_TIMEOUT_S = 300
CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "protrain.runtime",
    "protrain_demo.corpus",
    "protrain.runtime.config.spec_io",
    "protrain.runtime.entry",
    "bench_common",
]


class Kind(Enum):
    """The candidates, in the table's (and the interleaving's) order."""

    ALONE = "alone"
    DDP = "ddp"
    FSDP2 = "fsdp2"
    DEEPSPEED = "deepspeed"
    PROTRAIN_MIN = "protrain-min"
    PROTRAIN_MORE = "protrain-more"
    PROTRAIN_ALL = "protrain-all"
    PROTRAIN_AUTO = "protrain-auto"


PROTRAIN_KINDS = (Kind.PROTRAIN_MIN, Kind.PROTRAIN_MORE, Kind.PROTRAIN_ALL, Kind.PROTRAIN_AUTO)
PEER_LABELS = {
    Kind.ALONE: "PyTorch alone: no comms (floor)",
    Kind.DDP: "DDP + AdamW(fused)",
    Kind.FSDP2: "FSDP2 + CPUOffloadPolicy",
    Kind.DEEPSPEED: "DeepSpeed ZeRO-3 offload cpu",
}


class Phase(Enum):
    """What a pair of rank processes does."""

    TIME = "time"
    """Build every candidate and time them interleaved."""
    MEMORY = "memory"
    """Build one candidate alone and measure its resident set."""
    PLAN = "plan"
    """Plan ProTrain with n_persist=0 and every other knob auto: the chunk size it picks."""


class Unavailable(Exception):
    """A candidate that cannot run here; the message goes into its table row."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What a rank process does: time all ``kinds`` interleaved, or measure one's memory."""

    phase: Phase
    kinds: tuple[Kind, ...]
    args: argparse.Namespace
    output_dir: str
    profile_cache_dir: str
    """ProTrain's profiler.cache_dir: empty when the job starts (see the module docstring)."""
    n_buffer: dict[Kind, int] = field(default_factory=dict)
    """Memory phase: ProTrain's n_buffer found by the timing phase (no refused attempts here)."""
    chunk_size: str = "auto"
    """The all-offloaded candidates' ``memory.chunk_size``: ``--chunk-size``, or the planned one."""


@dataclass
class Trainer:
    """One candidate on one rank, stepping through the shared batch list."""

    kind: Kind
    label: str
    train_step: Callable[[Batch], torch.Tensor]
    """Forward, backward and update on one batch; returns the detached loss."""
    close: Callable[[], None] = lambda: None
    plan_info: dict[str, int] | None = None
    """ProTrain only: the plan's n_buffer, num_chunks and chunk size in bytes."""
    state_bytes: Callable[[], dict[str, int]] | None = None
    """ProTrain only: the bytes its host arena and its device tier hold now (the RSS breakdown)."""
    seconds: list[float] = field(default_factory=list)
    steps_taken: int = 0
    last_loss: float = float("nan")

    def run(self, batches: Sequence[Batch], num_steps: int) -> float:
        """Take the next ``num_steps`` steps; their wall time in seconds on this rank."""
        start = time.perf_counter()
        for _ in range(num_steps):
            self.last_loss = float(self.train_step(batches[self.steps_taken]))
            self.steps_taken += 1
        return time.perf_counter() - start


# ---------------------------------------------------------------- candidates (run inside a rank)


def build_alone(args: argparse.Namespace) -> Trainer:
    """The floor: each rank trains its own copy (no collectives at all), so its step is the
    compute and update every candidate pays, on cores shared with the other rank."""
    model = build_gpt(gpt_config(args))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )
    return Trainer(Kind.ALONE, PEER_LABELS[Kind.ALONE], torch_step(model, optimizer))


def build_ddp(args: argparse.Namespace) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_gpt(gpt_config(args)))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )
    return Trainer(Kind.DDP, PEER_LABELS[Kind.DDP], torch_step(model, optimizer))


def build_fsdp2(args: argparse.Namespace) -> Trainer:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    except ImportError as err:
        raise Unavailable(f"fully_shard missing in torch {torch.__version__}: {err}") from None
    model = build_gpt(gpt_config(args))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=False)
    # One unit per block, so only one block's full parameters exist at a time, plus the root for
    # the embeddings, final norm and (tied) head.
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )
    return Trainer(Kind.FSDP2, PEER_LABELS[Kind.FSDP2], torch_step(model, optimizer))


def build_deepspeed(args: argparse.Namespace) -> Trainer:
    """Untested here (deepspeed is not installed in this project's environment)."""
    try:
        import deepspeed
    except Exception as err:  # noqa: BLE001 - any import failure just means the row is skipped
        raise Unavailable(f"import deepspeed failed: {type(err).__name__}: {err}") from None
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
    }
    model = build_gpt(gpt_config(args))
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config, dist_init_required=False
    )

    def train_step(batch: Batch) -> torch.Tensor:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return Trainer(Kind.DEEPSPEED, PEER_LABELS[Kind.DEEPSPEED], train_step)


def torch_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Batch], torch.Tensor]:
    def train_step(batch: Batch) -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return train_step


def protrain_spec(args: argparse.Namespace, job: Job, n_buffer: int | str | None) -> dict[str, Any]:
    """The update the torch peers make: AdamW with torch's defaults but lr, decay on everything.
    ``n_buffer`` None: every knob but the budget and ``--chunk-size`` left to the planner (auto);
    otherwise ``n_persist=0`` with those buffers (or "auto") at the job's chunk size."""
    auto = n_buffer is None
    return {
        "seed": SEED,
        "micro_batch_size": args.batch,
        "precision": "fp32",
        "optimizer": {
            "lr": LR,
            "betas": list(BETAS),
            "eps": EPS,
            "weight_decay": WEIGHT_DECAY,
            "no_decay": [],
        },
        # A set budget, not auto: the timing phase keeps three engines alive in one process, and
        # only one engine of a process may plan for the whole device.
        "memory": {"device_budget": args.device_budget, "chunk_size": args.chunk_size if auto else job.chunk_size}
        | ({} if auto else {"n_persist": 0, "n_buffer": n_buffer}),
        "profiler": {"cache_dir": job.profile_cache_dir},
        "output_dir": job.output_dir,
    }


def build_protrain(kind: Kind, job: Job, example: Batch, *, first_n_buffer: int | None, exact: bool) -> Trainer:
    """``n_persist=0`` with ``first_n_buffer`` buffers, or (``exact`` False) the fewest from there
    up that ``initialize`` accepts, jumping to the minimum its refusal names. Every rank gets the
    same refusal at the same point, so the collectives stay in step."""
    from protrain import runtime
    from protrain.runtime.config.spec_io import SpecError

    args = job.args
    n_buffer = first_n_buffer
    while True:
        try:
            # The engine's console binds stdout when built; only the benchmark's table is output.
            with contextlib.redirect_stdout(io.StringIO()):
                engine = runtime.initialize(
                    build_gpt(gpt_config(args)),
                    config=protrain_spec(args, job, n_buffer),
                    example_batch=example,
                )
            break
        except SpecError as err:
            if exact or "n_buffer" not in str(err):
                raise
            named = re.search(r"n_buffer >= (\d+)", str(err))
            n_buffer = max(n_buffer + 1, int(named.group(1)) if named else 0)

    def train_step(batch: Batch) -> torch.Tensor:
        out = engine(**batch)
        engine.backward(out.loss)
        engine.step()
        return out.loss.detach()

    plan = engine.plan
    suffix = {Kind.PROTRAIN_MIN: " (min)", Kind.PROTRAIN_ALL: " (all)"}.get(kind, "")
    label = f"ProTrain n_persist=0 n_buffer={plan.n_buffer}{suffix}"
    if kind is Kind.PROTRAIN_AUTO:
        label = f"ProTrain auto: n_persist {plan.n_persist}/{plan.num_chunks}, n_replicate {plan.n_replicate}"
    plan_info = {"n_buffer": plan.n_buffer, "num_chunks": plan.num_chunks, "chunk_bytes": plan.chunk_size}

    def state_bytes() -> dict[str, int]:
        from protrain.runtime.hw.host_memory import host_arena_bytes

        # On CPU the device tier is RAM too: its chunk buffers and persistent chunks, as planned.
        persistent = plan.n_persist * plan.chunk_size
        return {"arena": host_arena_bytes()[0], "device_tier": plan.n_buffer * plan.chunk_size + persistent}

    return Trainer(kind, label, train_step, close=engine.close, plan_info=plan_info, state_bytes=state_bytes)


def plan_phase(job: Job, rank: int) -> dict[str, Any]:
    """The chunk size the planner picks for ``n_persist=0`` (every other knob auto), which the
    all-offloaded candidates then take (``--chunk-size auto``)."""
    from protrain import runtime

    batches = rank_batches(job.args, rank, 1)
    with contextlib.redirect_stdout(io.StringIO()):
        engine = runtime.initialize(
            build_gpt(gpt_config(job.args)), config=protrain_spec(job.args, job, "auto"), example_batch=batches[0]
        )
    plan = engine.plan
    engine.close()
    return {"chunk_size": plan.chunk_size, "n_buffer": plan.n_buffer, "num_chunks": plan.num_chunks}


def derived_n_buffer(kind: Kind, min_plan: dict[str, int] | None) -> dict[Kind, int]:
    """The buffers of the candidates set from the minimum-buffer plan (one more; one per chunk)
    once it is known; none for the minimum itself and auto, which find theirs."""
    if min_plan is None or kind not in (Kind.PROTRAIN_MORE, Kind.PROTRAIN_ALL):
        return {}
    more = min_plan["n_buffer"] + 1
    return {kind: max(more, min_plan["num_chunks"]) if kind is Kind.PROTRAIN_ALL else more}


def build(kind: Kind, job: Job, batches: Sequence[Batch], min_plan: dict[str, int] | None) -> Trainer:
    if kind is Kind.ALONE:
        return build_alone(job.args)
    if kind is Kind.DDP:
        return build_ddp(job.args)
    if kind is Kind.FSDP2:
        return build_fsdp2(job.args)
    if kind is Kind.DEEPSPEED:
        return build_deepspeed(job.args)
    if kind is Kind.PROTRAIN_AUTO:  # the planner's own choice, every knob but the budget auto
        return build_protrain(kind, job, batches[0], first_n_buffer=None, exact=True)
    if kind in job.n_buffer:
        first, exact = job.n_buffer[kind], True
    elif kind is Kind.PROTRAIN_MIN:
        first, exact = 1, False
    else:
        assert min_plan is not None, "the minimum-buffer engine is built first"
        first, exact = derived_n_buffer(kind, min_plan)[kind], True
    return build_protrain(kind, job, batches[0], first_n_buffer=first, exact=exact)


def probe(kind: Kind, job: Job, batches: Sequence[Batch], min_plan: dict[str, int] | None) -> Trainer | str:
    """Build the candidate and take its first (warm-up) step; the reason it cannot run, agreed
    by every rank, when it fails anywhere."""
    reason = ""
    trainer: Trainer | None = None
    try:
        trainer = build(kind, job, batches, min_plan)
        trainer.run(batches, 1)
    except Unavailable as err:
        reason = str(err)
    except Exception as err:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
        if kind in PROTRAIN_KINDS:
            raise
        first_line = (str(err).splitlines() or [""])[0][:120]
        reason = f"failed: {type(err).__name__}: {first_line}"
    failed = torch.tensor([1.0 if reason else 0.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        if trainer is not None:
            trainer.close()
        return reason or "failed on another rank"
    assert trainer is not None
    return trainer


# ---------------------------------------------------------------- phases (run inside a rank)


def rank_batches(args: argparse.Namespace, rank: int, count: int) -> list[Batch]:
    """This rank's share of ``count`` global batches (``args.batch`` samples per rank each)."""
    from protrain_demo.corpus import LMBatches, stdlib_text_corpus

    data = LMBatches(
        tokens=stdlib_text_corpus(),
        seq_len=args.seq_len,
        micro_batch_size=args.batch,
        gradient_accumulation_steps=1,
        world_size=dist.get_world_size(),
        seed=SEED,
    )
    return [data.batch(update, 0, rank) for update in range(count)]


def time_phase(job: Job, rank: int) -> dict[str, Any]:
    args = job.args
    batches = rank_batches(args, rank, args.warmup + args.steps * args.repeats)
    trainers: list[Trainer] = []
    result: dict[str, Any] = {"rows": {}, "plan": {}}
    min_plan: dict[str, int] | None = None
    for kind in job.kinds:
        built = probe(kind, job, batches, min_plan)
        if isinstance(built, str):
            result["rows"][kind.value] = {"label": PEER_LABELS.get(kind, kind.value), "reason": built}
            continue
        trainers.append(built)
        if built.plan_info is not None:
            result["plan"][kind.value] = built.plan_info
            if kind is Kind.PROTRAIN_MIN:
                min_plan = built.plan_info
    for trainer in trainers:
        trainer.run(batches, args.warmup - 1)  # the probe took the first warm-up step
    for repeat in range(args.repeats):
        for trainer in trainers if repeat % 2 == 0 else list(reversed(trainers)):
            dist.barrier()
            elapsed = torch.tensor([trainer.run(batches, args.steps)], dtype=torch.float64)
            # A step ends when the slower rank's does.
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            trainer.seconds.append(elapsed.item() / args.steps)
    for trainer in trainers:
        result["rows"][trainer.kind.value] = {
            "label": trainer.label,
            "seconds": trainer.seconds,
            "loss": trainer.last_loss,
        }
        trainer.close()
    return result


def read_status_kib(field_name: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field_name} missing from {STATUS}")


def reset_peak_rss() -> bool:
    """Make VmHWM the current RSS (Linux >= 4.0); False where that is not permitted."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``), so that the resident
    set shrinks to what is live; glibc otherwise keeps freed memory resident and every later
    measurement would start from the setup's high-water mark. A no-op without glibc."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def memory_phase(job: Job, rank: int) -> dict[str, Any]:
    """One candidate alone in fresh processes: resident-set growth over the pre-model baseline
    (MiB): the whole run's peak, what stays live between steps, and the peak of the later steps."""
    (kind,) = job.kinds
    args = job.args
    batches = rank_batches(args, rank, args.warmup + args.memory_steps)
    cache = Path(job.profile_cache_dir)
    cache_was_empty = not any(cache.iterdir())
    trim_heap()
    baseline_kib = read_status_kib("VmRSS")
    reset_peak_rss()
    built = probe(kind, job, batches, None)
    if isinstance(built, str):
        return {"reason": built}
    built.run(batches, args.warmup - 1)
    setup_hwm_kib = read_status_kib("VmHWM")
    trim_heap()
    live_kib = read_status_kib("VmRSS")
    can_reset = reset_peak_rss()
    built.run(batches, args.memory_steps)
    end_hwm_kib = read_status_kib("VmHWM")
    state = built.state_bytes() if built.state_bytes is not None else {}
    built.close()
    return {
        "baseline_mib": baseline_kib / 1024,
        **{f"{name}_mib": value / 2**20 for name, value in state.items()},
        # A model profile in a cache that started empty was measured inside this peak.
        "profiled": cache_was_empty and any(cache.glob("model-*.json")) if kind in PROTRAIN_KINDS else None,
        "peak_mib": (max(setup_hwm_kib, end_hwm_kib) - baseline_kib) / 1024,
        "live_mib": (live_kib - baseline_kib) / 1024,
        # Without the reset, VmHWM still holds the setup's peak: no separate figure for the steps.
        "steps_mib": (end_hwm_kib - baseline_kib) / 1024 if can_reset else None,
    }


def rank_main(rank: int, port: int, job: Job, results: Any) -> None:
    """Entry of a rank process: join the gloo group, run the phase, send back plain values (the
    script's classes live in ``__mp_main__`` here, which the parent could not unpickle)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    # Peers (and the hardware probe, on other backends) still call the collective names torch
    # 2.13 deprecates; one warning per call site and rank would bury the table.
    warnings.filterwarnings(
        "ignore",
        message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    dist.init_process_group("gloo", timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    try:
        phase = {Phase.TIME: time_phase, Phase.MEMORY: memory_phase, Phase.PLAN: plan_phase}[job.phase]
        results.put((rank, True, phase(job, rank)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(job: Job, timeout_s: float) -> list[dict[str, Any]]:
    """Spawn a fresh pair of rank processes for ``job``; their results in rank order."""
    context = mp.get_context("forkserver")
    # The fork server imports these once; every fresh pair is then a fork of a clean process (no
    # threads, no process group) instead of a new interpreter importing torch again: seconds per
    # pair, which the one-pair-per-candidate memory phase pays five times.
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=rank_main, args=(rank, port, job, results)) for rank in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < WORLD_SIZE:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died without a word (killed, crashed in C++) would leave us waiting
                # for the whole timeout; a clean exit may still have a result in flight.
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"a rank exited with {dead[0]}" if dead else f"no result within {timeout_s:.0f} s"
                    raise SystemExit(f"bench_peers: {job.phase.value} phase: {why}") from None
                continue
            if not ok:
                raise SystemExit(f"bench_peers: rank {rank} failed in the {job.phase.value} phase:\n{value}")
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [got[rank] for rank in range(WORLD_SIZE)]


def planned_chunk_size(args: argparse.Namespace, kinds: Sequence[Kind], output_dir: str, cache: str) -> str:
    """``--chunk-size``, or (auto) the size a pair of ranks plans for ``n_persist=0``."""
    if args.chunk_size != "auto" or not any(k in PROTRAIN_KINDS and k is not Kind.PROTRAIN_AUTO for k in kinds):
        return str(args.chunk_size)
    job = Job(phase=Phase.PLAN, kinds=(), args=args, output_dir=output_dir, profile_cache_dir=cache)
    planned = run_ranks(job, args.timeout_s)[0]
    return f"{planned['chunk_size']}B"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument(
        "--chunk-size",
        default="auto",
        help="ProTrain memory.chunk_size (e.g. 8MiB); auto: the size the planner picks for n_persist=0 "
        "(planned once, then set for every all-offloaded candidate; the auto candidate plans its own)",
    )
    parser.add_argument(
        "--device-budget",
        default="4GiB",
        help="ProTrain memory.device_budget per engine (set, not auto: the timing phase keeps its three "
        "engines alive in one process); the default holds every activation of the default model",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per candidate per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate first (>= 1)")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps after warm-up in the memory phase")
    parser.add_argument("--timeout-s", type=float, default=900, help="per phase, for the ranks' results")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[kind.value for kind in Kind if kind is not Kind.DDP],
        help="time and measure only these candidates beside DDP (the minimum-buffer plan comes along "
        "when another all-offloaded one is named: theirs derive from it)",
    )
    parser.add_argument("--smoke", action="store_true", help="one tiny step of each (a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.heads, args.seq_len, args.batch = 2, 64, 2, 32, 2
        args.steps, args.repeats, args.warmup, args.memory_steps = 1, 1, 1, 1
    sizes = (args.layers, args.width, args.heads, args.seq_len, args.batch)
    if min(*sizes, args.steps, args.repeats, args.warmup, args.memory_steps) < 1:
        parser.error("sizes, --steps, --repeats, --warmup and --memory-steps must be positive")
    return args


def chunk_words(args: argparse.Namespace, plan: dict[str, int]) -> str:
    """The all-offloaded candidates' chunk size as the header gives it."""
    size = plan.get("chunk_bytes")
    if size is None:
        return str(args.chunk_size)
    planned = " as planned for n_persist=0" if args.chunk_size == "auto" else ""
    return f"{size / 2**20:.2f} MiB{planned}"


def deepspeed_importable() -> bool:
    # find_spec instead of an import: the parent need not pay for importing deepspeed; the ranks
    # import it for real and report a failure in the row.
    return importlib.util.find_spec("deepspeed") is not None


def fmt_ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}x"


def fmt_mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def print_table(
    rows: dict[Kind, dict[str, Any]],
    memory: dict[Kind, dict[str, Any]],
    *,
    header: str,
    args: argparse.Namespace,
) -> None:
    def median(kind: Kind) -> float | None:
        seconds = rows.get(kind, {}).get("seconds")
        return statistics.median(seconds) if seconds else None

    def peak(kind: Kind) -> float | None:
        return memory.get(kind, {}).get("peak_mib")

    ddp_s, fsdp_s, ddp_mib = median(Kind.DDP), median(Kind.FSDP2), peak(Kind.DDP)
    floor_s = median(Kind.ALONE)
    print(header)
    title = (
        f"{'candidate':<40}{'s/step':>8}{'min-max (s)':>14}{'vs DDP':>8}{'vs FSDP2':>10}"
        f"{'peak MiB':>10}{'live MiB':>10}{'steps MiB':>11}{'mem vs DDP':>12}{'final loss':>12}"
    )
    print(title)
    print("-" * len(title))

    def vs_ddp(kind: Kind) -> float | None:
        """The candidate's median over DDP's, its own pair's DDP where it had one."""
        step_s, beside = median(kind), rows.get(kind, {}).get("ddp_seconds")
        base = statistics.median(beside) if beside else ddp_s
        return None if step_s is None or not base else step_s / base

    def vs_fsdp2(kind: Kind) -> float | None:
        ratio = vs_ddp(kind)
        return None if ratio is None or not fsdp_s or ddp_s is None else ratio * ddp_s / fsdp_s

    for kind in Kind:
        row = rows[kind]
        if "reason" in row:
            print(f"{row['label']:<40}  {row['reason']}")
            continue
        seconds, step_s, mib = row["seconds"], median(kind), memory[kind]
        spread = f"{min(seconds):.3f}-{max(seconds):.3f}"
        print(
            f"{row['label']:<40}{step_s:>8.3f}{spread:>14}{fmt_ratio(vs_ddp(kind), 1.0):>8}"
            f"{fmt_ratio(vs_fsdp2(kind), 1.0):>10}{fmt_mib(mib['peak_mib']):>10}{fmt_mib(mib['live_mib']):>10}"
            f"{fmt_mib(mib['steps_mib']):>11}{fmt_ratio(peak(kind), ddp_mib):>12}{row['loss']:>12.5f}"
        )
    if floor_s is not None:
        print(
            f"floor: with no communication at all a step takes {fmt_ratio(floor_s, fsdp_s)} FSDP2's "
            f"({fmt_ratio(floor_s, ddp_s)} DDP's); a target below that cannot be met on this machine"
        )
    measured = [kind for kind in PROTRAIN_KINDS if kind in memory]
    profiled = sum(1 for kind in measured if memory[kind]["profiled"])
    print(
        f"ProTrain peak MiB includes profiling: each memory run started from an empty profile cache, "
        f"as a user's first run does (profiled in {profiled} of {len(measured)} runs)"
    )
    # Issue 3's target is the all-offloaded candidates'; auto's is issue 29's (below).
    for kind in (kind for kind in PROTRAIN_KINDS[:3] if "reason" not in rows[kind]):
        versus, mib = vs_fsdp2(kind), peak(kind)
        if versus is None or ddp_mib is None or mib is None:
            print(f"{rows[kind]['label']}: target (issue 3) not checkable (DDP or FSDP2 did not run)")
            continue
        fast = "met" if versus <= TARGET_VS_FSDP2 else "NOT met"
        lean = "met" if mib <= ddp_mib else "NOT met"
        print(
            f"target (issue 3) for {rows[kind]['label']}: step time {versus:.2f}x FSDP2 "
            f"(<= {TARGET_VS_FSDP2:.1f}x: {fast}); peak memory {mib / ddp_mib:.2f}x DDP (<= 1.00x: {lean})"
        )
    for kind in PROTRAIN_KINDS[:3]:
        mib = memory.get(kind, {})
        if "arena_mib" in mib:
            rest = mib["peak_mib"] - mib["arena_mib"] - mib["device_tier_mib"]
            print(
                f"RSS of {rows[kind]['label']} (rank max): baseline {mib['baseline_mib']:.0f} MiB before the "
                f"model (interpreter, torch, gloo, batches); peak growth {mib['peak_mib']:.0f} = host arena "
                f"{mib['arena_mib']:.0f} (fp32 masters, moments, gradients, staging) + device tier "
                f"{mib['device_tier_mib']:.0f} (chunk buffers) + {rest:.0f} else (activations, gradient "
                "buffers in flight, the model as built before chunking, profiling, allocator slack)"
            )
    if ddp_s is not None and ddp_mib is not None:
        targets = [(Kind.PROTRAIN_AUTO, 1.02, None)] + [(kind, 1.05, 1.10) for kind in PROTRAIN_KINDS[:3]]
        for kind, most_s, most_mib in targets:
            versus, mib = vs_ddp(kind), peak(kind)
            if versus is None or mib is None:
                continue
            met = "met" if versus <= most_s else "NOT met"
            words = f"step time {versus:.3f}x DDP (<= {most_s:.2f}x: {met})"
            if most_mib is not None:
                met = "met" if mib <= most_mib * ddp_mib else "NOT met"
                words += f"; peak memory {mib / ddp_mib:.2f}x DDP (<= {most_mib:.2f}x: {met})"
            print(f"target (issue 29) for {rows[kind]['label']}: {words}")
    print(
        f"s/step: median over {args.repeats} interleaved repeats of {args.steps} timed steps per candidate "
        f"(after {args.warmup} warm-up steps), the slower rank's time; ratios are of the medians, each "
        "ProTrain candidate's against the DDP timed beside it in its own pair of processes.\n"
        "Memory: per rank (the larger of the 2), each candidate alone in a fresh pair of processes, as "
        "growth of the resident set over its VmRSS before the model was built. peak MiB: VmHWM over "
        f"model construction, setup and {args.warmup + args.memory_steps} steps (the target's figure); "
        "live MiB: VmRSS after the warm-up steps once freed heap pages are returned (malloc_trim), i.e. "
        f"what the candidate holds between steps; steps MiB: VmHWM over the last {args.memory_steps} "
        "step(s) from there (reset via /proc/self/clear_refs).\n"
        "These are CPU figures: the device is host RAM, so offloaded state still counts in the resident "
        "set, transfers are memcpys on the same 2 cores as compute, and FSDP2's CPU offload copies "
        "CPU to CPU."
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    kinds = [kind for kind in Kind if kind is not Kind.DEEPSPEED or deepspeed_importable()]
    if args.only:
        wanted = {Kind.DDP, *(Kind(value) for value in args.only)}
        if wanted & {Kind.PROTRAIN_MORE, Kind.PROTRAIN_ALL}:
            wanted.add(Kind.PROTRAIN_MIN)
        kinds = [kind for kind in kinds if kind in wanted]
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as output_dir:

        def empty_cache(name: str) -> str:
            return tempfile.mkdtemp(prefix=f"profile-cache-{name}-", dir=output_dir)

        time_cache = empty_cache("time")
        chunk_size = planned_chunk_size(args, kinds, output_dir, time_cache)
        peers = tuple(kind for kind in kinds if kind not in PROTRAIN_KINDS)
        timing_job = Job(phase=Phase.TIME, kinds=peers, args=args, output_dir=output_dir, profile_cache_dir=time_cache)
        timed = run_ranks(timing_job, args.timeout_s)[0]
        rows = {Kind(key): value for key, value in timed["rows"].items()}
        plans: dict[Kind, dict[str, int]] = {}
        for kind in (kind for kind in PROTRAIN_KINDS if kind in kinds):  # each beside a DDP of its own
            pair_job = Job(
                phase=Phase.TIME,
                kinds=(Kind.DDP, kind),
                args=args,
                output_dir=output_dir,
                profile_cache_dir=time_cache,
                n_buffer=derived_n_buffer(kind, plans.get(Kind.PROTRAIN_MIN)),
                chunk_size=chunk_size,
            )
            pair = run_ranks(pair_job, args.timeout_s)[0]
            rows[kind] = {**pair["rows"][kind.value], "ddp_seconds": pair["rows"][Kind.DDP.value].get("seconds")}
            plans[kind] = pair["plan"][kind.value]
        if Kind.DEEPSPEED not in rows:
            rows[Kind.DEEPSPEED] = {"label": PEER_LABELS[Kind.DEEPSPEED], "reason": "not installed"}
        for kind in Kind:
            rows.setdefault(kind, {"label": PEER_LABELS.get(kind, kind.value), "reason": "not asked for (--only)"})
        memory: dict[Kind, dict[str, Any]] = {}
        for kind in kinds:
            if "reason" in rows[kind]:
                continue
            n_buffer = {kind: plans[kind]["n_buffer"]} if kind in plans else {}
            # Its own empty profile cache: ProTrain profiles within the measured peak, as a first run.
            job = Job(
                phase=Phase.MEMORY,
                kinds=(kind,),
                args=args,
                output_dir=output_dir,
                profile_cache_dir=empty_cache(kind.value),
                n_buffer=n_buffer,
                chunk_size=chunk_size,
            )
            per_rank = run_ranks(job, args.timeout_s)
            if any("reason" in result for result in per_rank):
                raise SystemExit(f"bench_peers: {kind.value} ran in the timing phase, not alone: {per_rank}")
            # Per rank means the worse rank: the one that sets the machine size.
            memory[kind] = {
                key: None if any(r[key] is None for r in per_rank) else max(r[key] for r in per_rank)
                for key in ("peak_mib", "live_mib", "steps_mib")
            }
            memory[kind]["profiled"] = all(r["profiled"] for r in per_rank)
            # The breakdown is one rank's, the one with the higher peak, so that its parts add up.
            worst = max(per_rank, key=lambda r: r["peak_mib"])
            parts = ("baseline_mib", "arena_mib", "device_tier_mib")
            memory[kind].update({k: v for k, v in worst.items() if k in parts})
    num_params = sum(p.numel() for p in build_gpt(gpt_config(args)).parameters())
    protrain = plans.get(Kind.PROTRAIN_MIN, {})
    # Whole parameters per chunk leave gaps; the padding is sharded and offloaded like the rest,
    # so it shows in ProTrain's memory (fp32 masters, gradients, Adam moments and snapshots).
    chunked = protrain.get("num_chunks", 0) * protrain.get("chunk_bytes", 0) / (num_params * 4)
    offloaded = (
        f"; ProTrain chunk_size {chunk_words(args, protrain)} ({protrain['num_chunks']} chunks, {chunked:.2f}x "
        "the fp32 parameter bytes), n_persist=0"
        if "num_chunks" in protrain
        else ""  # no all-offloaded candidate ran (--only)
    )
    header = (
        f"ProTrain (all optimizer state offloaded) vs peers on {WORLD_SIZE} CPU ranks (gloo, 1 thread each); "
        f"CPU figures, torch {torch.__version__}, fp32, AdamW lr {LR:g}\n"
        f"model: GPT {args.layers} layers x width {args.width}, {num_params / 1e6:.1f}M parameters; batch "
        f"{args.batch} x {args.seq_len} tokens per rank{offloaded}"
    )
    print_table(rows, memory, header=header, args=args)


if __name__ == "__main__":
    main()

"""Stage ``calibration`` of the first-contact run (issue 26, item 7): the rates and costs the cost
model and the pipeline rest on, each measured directly, cheapest and most telling first.

1. A memory-counter reading (``runtime.hw.memory_counter.device_peak_since_last_sample``: on CUDA
   ``max_memory_allocated`` and a reset), timed over N readings, beside its two calls alone:
   the engine reads it at every module's forward and every gradient (issue 26, item 4).
2. Copy rates between host and device, host to device and back, from a region registered with
   ``cudaHostRegister`` (``runtime.hw.host_memory.MmapArena``: the host tier's memory), from
   ``pin_memory`` allocations and from pageable memory. On CUDA the registered rate must reach
   80% of the pinned one (the host tier is registered memory; a refused registration is
   reported). On CPU both are plain memory: figures only.
3. A copy issued on the runtime's side stream under a chunk's job label (``protrain.gather.3``,
   and a copy back under ``protrain.reduce.5``), traced with every thread profiled
   (``runtime.observability.profiling``) and read back with the overlap stage's parser
   (``trace_overlap.parse_trace``): on CUDA each device copy must be attributed to its chunk
   through the launch links; on CPU, which has no device copies, the labels' own ranges count.
4. The host worker's arithmetic alone and beside CPU Adam, and CPU Adam at two sizes
   (calibration_host.py).
5. The planner's own hardware probe (``runtime.planning.hardware_probes.measure_hardware``,
   world size 1, no process group), every field recorded as it comes.

Sizes (GPU / rehearsal): copies 256 / 8 MiB; host arithmetic over 64 / 1 Mi elements, CPU Adam
beside it over 32 / 1 Mi parameters; CPU Adam at 4 and 256 / 0.25 and 2 Mi parameters; 2000 /
200 counter readings. Expected on one H100 with 16 cores: 30-50 s (the 256M-parameter Adam's
4 GiB of state and ``measure_hardware`` dominate); the rehearsal about 5 s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_checks.calibration_host import HostSizes, adam_rates, host_rates
from gpu_checks.common import Context, Figure, Section

MIB = 1 << 20
REGISTERED_VS_PINNED = 0.8
"""On CUDA the registered region's copy rate must reach this share of pinned memory's."""


@dataclass(frozen=True, slots=True)
class Sizes:
    copy_bytes: int
    readings: int
    host: HostSizes


GPU = Sizes(
    copy_bytes=256 * MIB, readings=2000,
    host=HostSizes(numel=64 * MIB, adam_beside_numel=32 * MIB, adam_numels=(4 * MIB, 256 * MIB), repeats=3),
)
REHEARSAL = Sizes(
    copy_bytes=8 * MIB, readings=200,
    host=HostSizes(numel=1 * MIB, adam_beside_numel=1 * MIB, adam_numels=(MIB // 4, 2 * MIB), repeats=2),
)


def device_info(ctx: Context) -> Any:
    from protrain.runtime.hw.device import DeviceInfo

    return DeviceInfo(ctx.device, "nccl" if ctx.is_cuda else "gloo")


def timed_device(ctx: Context, work: Callable[[], object], repeats: int = 3) -> float:
    """Best wall seconds of ``work`` with the device synchronized around it."""
    work()
    ctx.synchronize()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        ctx.synchronize()
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-9)


def counter_cost(ctx: Context, readings: int) -> None:
    from protrain.runtime.hw.device import device_allocated_bytes
    from protrain.runtime.hw.memory_counter import device_peak_since_last_sample

    info = device_info(ctx)

    def per_call(call: Callable[[], object]) -> float:
        call()
        started = time.perf_counter()
        for _ in range(readings):
            call()
        return (time.perf_counter() - started) / readings

    reading = per_call(lambda: device_peak_since_last_sample(info))
    figures: dict[str, Figure] = {"readings": readings, "us_per_reading": round(reading * 1e6, 2)}
    if ctx.is_cuda:
        peak = per_call(lambda: torch.cuda.max_memory_allocated(ctx.device))
        figures["us_max_memory_allocated"] = round(peak * 1e6, 2)
        figures["us_reset_peak"] = round(per_call(lambda: torch.cuda.reset_peak_memory_stats(ctx.device)) * 1e6, 2)
    else:
        figures["us_allocated_bytes"] = round(per_call(lambda: device_allocated_bytes(info)) * 1e6, 2)
    ctx.check(
        "memory-counter reading",
        None,
        f"{reading * 1e6:.1f} us per reading over {readings} (one per module forward and per gradient "
        f"in the engine: {reading * 1e9:.0f} ms per million readings)",
        **figures,
    )


def copy_rates(ctx: Context, nbytes: int) -> None:
    """Registered vs pinned vs pageable, both directions."""
    from protrain.runtime.hw.host_memory import MmapArena

    numel = nbytes // 4
    on_device = torch.empty(numel, device=ctx.device)
    rates: dict[str, tuple[float, float]] = {}
    sources: dict[str, Callable[[], tuple[torch.Tensor, Callable[[], None]]]] = {}

    fallback: list[str] = []

    def registered() -> tuple[torch.Tensor, Callable[[], None]]:
        # A host that refuses cudaHostRegister either raises or (with a fallback) warns and
        # takes pinned memory instead: the "registered" rate is then the fallback's.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            arena = MmapArena(nbytes, pin=ctx.is_cuda)
        fallback.extend(str(w.message).splitlines()[0] for w in caught)
        return arena.allocate(numel, torch.float32), arena.close

    sources["registered"] = registered
    sources["pinned"] = lambda: (torch.empty(numel, pin_memory=ctx.is_cuda), lambda: None)
    if ctx.is_cuda:
        sources["pageable"] = lambda: (torch.empty(numel), lambda: None)
    refused = ""
    for name, make in sources.items():
        try:
            host, release = make()
        except RuntimeError as error:  # cudaHostRegister refused (some virtualised hosts)
            refused = f"{name}: {str(error).splitlines()[0]}"
            continue
        host.fill_(1.0)
        blocking = name == "pageable" or not ctx.is_cuda
        h2d = timed_device(ctx, lambda h=host: on_device.copy_(h, non_blocking=not blocking))
        d2h = timed_device(ctx, lambda h=host: h.copy_(on_device, non_blocking=not blocking))
        rates[name] = (nbytes / h2d, nbytes / d2h)
        del host
        release()
    figures: dict[str, Figure] = {"bytes": nbytes, "registration_refused": bool(refused or fallback)}
    for name, (h2d, d2h) in rates.items():
        figures[f"{name}_h2d_gbps"] = round(h2d / 1e9, 2)
        figures[f"{name}_d2h_gbps"] = round(d2h / 1e9, 2)
    words = "; ".join(f"{name} {h / 1e9:.1f} up, {d / 1e9:.1f} down GB/s" for name, (h, d) in rates.items())
    if "registered" in rates and "pinned" in rates:
        ratio = min(rates["registered"][i] / rates["pinned"][i] for i in (0, 1))
        figures["registered_vs_pinned"] = round(ratio, 3)
        passed = ratio >= REGISTERED_VS_PINNED if ctx.is_cuda else None
    else:
        passed = False if ctx.is_cuda else None
    ctx.check(
        "copy rates: registered vs pinned",
        passed,
        f"{nbytes / MIB:.0f} MiB: {words}" + (f"; REFUSED {refused}" if refused else "")
        + (f"; REGISTRATION REFUSED, fell back: {fallback[0]}" if fallback else "")
        + ("" if ctx.is_cuda else "; CPU: both are plain memory, figures only"),
        **figures,
    )


def labelled_copies(ctx: Context, nbytes: int) -> None:
    """A side-stream copy up under ``protrain.gather.3`` and one back under ``protrain.reduce.5``,
    beside compute on the main thread, traced and parsed as the overlap stage parses its trace."""
    from gpu_checks.trace_overlap import parse_trace
    from protrain.runtime.chunks.trace_labels import job_label
    from protrain.runtime.hw.device import SideStream
    from protrain.runtime.observability.profiling import profile_every_thread

    numel = nbytes // 4
    host = torch.ones(numel, pin_memory=ctx.is_cuda)
    back = torch.empty(numel, pin_memory=ctx.is_cuda)
    on_device = torch.empty(numel, device=ctx.device)
    a = torch.randn(1024, 1024, device=ctx.device)
    side = SideStream(device_info(ctx))

    def gather() -> None:
        with job_label("gather", 3):
            on_device.copy_(host, non_blocking=ctx.is_cuda)

    def reduce() -> None:
        with job_label("reduce", 5):
            back.copy_(on_device, non_blocking=ctx.is_cuda)

    path = ctx.scratch / "calibration-trace.json"
    try:
        with profile_every_thread(ctx.is_cuda) as prof:
            uploaded = side.submit(gather)
            for _ in range(8):
                torch.mm(a, a)  # compute beside the copy: the trace then has a compute stream
            side.make_compute_wait(uploaded)
            side.submit(reduce).wait()
            ctx.synchronize()
        prof.export_chrome_trace(str(path))
    finally:
        side.close()
    trace = json.loads(path.read_text())
    parts = parse_trace(trace, cuda=ctx.is_cuda, main_tid=threading.main_thread().native_id)
    found = {key: sum(end - start for start, end in spans) for key, spans in parts.work.items()}
    wanted = (("gather", 3), ("reduce", 5))
    ok = all(key in found for key in wanted)
    what = "device copies attributed through the launch links" if ctx.is_cuda else "CPU: the labels' own ranges"
    ctx.check(
        "trace: a labelled side-thread copy is attributed to its chunk",
        ok,
        f"{what}: " + ", ".join(f"{k}.{c} {found.get((k, c), 0.0):.0f} us" for k, c in wanted)
        + f"; {parts.labels} labels, unattributed copies {parts.unlabelled_copy_s * 1e6:.0f} us",
        gather_3_us=round(found.get(("gather", 3), 0.0), 1),
        reduce_5_us=round(found.get(("reduce", 5), 0.0), 1),
        labels=parts.labels,
        unlabelled_copy_us=round(parts.unlabelled_copy_s * 1e6, 1),
        trace_mb=round(os.path.getsize(path) / 1e6, 2),
    )


def hardware_profile(ctx: Context) -> None:
    from protrain.runtime.planning.hardware_probes import measure_hardware

    started = time.perf_counter()
    profile = measure_hardware(device_info(ctx), None, world_size=1)
    seconds = time.perf_counter() - started
    figures: dict[str, Figure] = {}
    for name, value in dataclasses.asdict(profile).items():  # whatever fields this version has
        figures[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    ctx.check(
        "measure_hardware (the planner's probe)",
        None,
        f"every field of HardwareProfile, measured in {seconds:.1f} s (world size 1, no process group)",
        probe_seconds=round(seconds, 2),
        **figures,
    )


def run(ctx: Context) -> None:
    from protrain.runtime.hw.device import host_worker_threads

    sizes = REHEARSAL if ctx.rehearsal else GPU
    threads = host_worker_threads(device_info(ctx))
    counter_cost(ctx, sizes.readings)
    copy_rates(ctx, sizes.copy_bytes)
    labelled_copies(ctx, sizes.copy_bytes // 4)
    host_rates(ctx, sizes.host, threads)
    adam_rates(ctx, dataclasses.replace(sizes.host, adam_numels=sizes.host.adam_numels[:1]), threads)
    hardware_profile(ctx)
    adam_rates(ctx, dataclasses.replace(sizes.host, adam_numels=sizes.host.adam_numels[1:]), threads)


SECTION = Section(
    name="calibration",
    title="copy, host and CPU Adam rates, a memory-counter reading, a labelled copy in a trace",
    run=run,
    cpu_counterpart=(
        "tests/unit/test_cpu_adam.py, tests/unit/test_trace_labels.py, "
        "tests/unit/test_gpu_check_trace_overlap.py"
    ),
)

"""The host for the report: the CPU (model, the SIMD the CPU Adam kernels can use, cores and
this process's affinity, torch's threads) and memory (RAM, the cgroup limit a container sets,
the memory-lock limit, /dev/shm).

The host budget ("auto") is what this node has free for the job less a reserve: the smallest of
available RAM, the cgroup headroom (what ends a job: the kernel's OOM killer) and Slurm's
allocation, read by the one function the budget uses (``runtime.hw.host_capacity``). Files are
read from a root folder argument so tests can hand in their own /proc and /sys.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import psutil

from protrain.runtime.commands.env_report.rows import Row, Status, format_bytes, run_probe
from protrain.runtime.hw.host_capacity import cgroup_limit, free_host_bytes, slurm_source

SIMD_FLAGS = {
    "AVX2": ("avx2",),
    "AVX-512": ("avx512f",),
    "AVX-512 BF16": ("avx512_bf16",),
    "AMX": ("amx_tile", "amx_bf16"),
    "NEON/ASIMD": ("asimd",),
    "SVE": ("sve",),
}
"""What the report looks for in /proc/cpuinfo's flags (x86) or Features (Arm)."""


def cpu_rows(root: Path = Path("/")) -> list[Row]:
    info = _cpuinfo(root)
    model = info.get("model name") or info.get("Hardware") or info.get("CPU part") or "unknown"
    flags = set((info.get("flags") or info.get("Features") or "").split())
    rows = [Row("CPU model", model), simd_row(flags)]
    rows += run_probe("torch CPU kernels", _torch_capability_rows)
    logical = os.cpu_count()
    physical = psutil.cpu_count(logical=False)
    counts = {"logical": logical, "physical": physical}
    rows.append(Row("cores", f"{logical} logical, {physical or '?'} physical", counts))
    rows += run_probe("affinity", _affinity_rows)
    return rows


def simd_row(flags: set[str]) -> Row:
    found = {name: all(flag in flags for flag in needed) for name, needed in SIMD_FLAGS.items()}
    if not flags:
        return Row("SIMD", "unknown: /proc/cpuinfo lists no flags", status=Status.NOTE)
    x86 = "avx" in flags or "sse2" in flags
    shown = [name for name in found if (name in ("NEON/ASIMD", "SVE")) != x86]
    text = ", ".join(f"{name} {'yes' if found[name] else 'no'}" for name in shown)
    return Row("SIMD", text, {name: found[name] for name in shown})


def memory_rows(root: Path = Path("/")) -> list[Row]:
    memory = psutil.virtual_memory()
    rows = [
        Row(
            "RAM",
            f"{format_bytes(memory.total)} total, {format_bytes(memory.available)} available",
            {"total": memory.total, "available": memory.available},
        )
    ]
    rows += run_probe("cgroup memory limit", lambda: [cgroup_row(root, memory.available)])
    rows += run_probe("Slurm memory", lambda: [slurm_row()])
    rows += run_probe("free for the job", lambda: [free_row(root)])
    rows += run_probe("memory lock limit", lambda: [memlock_row()])
    rows += run_probe("/dev/shm", lambda: [_shm_row(root)])
    return rows


def cgroup_row(root: Path, available: int) -> Row:
    """The tightest memory limit on this process's cgroup and its ancestors (v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``), beside the RAM the host budget would count on."""
    found = cgroup_limit(root)
    if found is None:
        return Row("cgroup memory limit", "none found (no memory cgroup, or not Linux)")
    limit, where = found
    if limit is None:
        return Row("cgroup memory limit", f"unlimited ({where})")
    text = f"{format_bytes(limit)} ({where})"
    if limit < available:
        text += (
            f"; below the {format_bytes(available)} of available RAM that memory.host_budget auto "
            "counts on: set memory.host_budget under the limit"
        )
        return Row("cgroup memory limit", text, limit, Status.NOTE)
    return Row("cgroup memory limit", text, limit)


def slurm_row() -> Row:
    source = slurm_source(os.environ, ranks_on_host=_local_ranks())
    return Row("Slurm memory", source.detail, source.free_bytes)


def free_row(root: Path) -> Row:
    """What memory.host_budget auto divides among this node's ranks (``runtime.hw.host_capacity``:
    the smallest of available RAM, the cgroup headroom and Slurm's allocation)."""
    free, source = free_host_bytes(root=root, ranks_on_host=_local_ranks())
    return Row("free for the job", f"{format_bytes(free)} (the tightest: {source.name}; {source.detail})", free)


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        return 1


def memlock_row() -> Row:
    """RLIMIT_MEMLOCK: how much memory this process may lock with mlock. RDMA registrations
    (NCCL over InfiniBand or RoCE) count against it; a small limit fails them at start-up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def shown(limit: int) -> str:
        return "unlimited" if limit == resource.RLIM_INFINITY else format_bytes(limit)

    def figure(limit: int) -> int | None:
        return None if limit == resource.RLIM_INFINITY else limit

    text = f"{shown(soft)} (hard {shown(hard)})"
    value = {"soft": figure(soft), "hard": figure(hard)}
    if soft != resource.RLIM_INFINITY and soft < 1 << 30:
        text += "; small for NCCL over RDMA: raise `ulimit -l` (or the container's memlock ulimit)"
        return Row("memory lock limit", text, value, Status.NOTE)
    return Row("memory lock limit", text, value)


def _shm_row(root: Path) -> Row:
    """/dev/shm, where NCCL's shared-memory transport and DataLoader workers put their buffers;
    containers default it to 64 MiB."""
    stat = os.statvfs(root / "dev/shm")
    size, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
    text = f"{format_bytes(size)} ({format_bytes(free)} free)"
    if size < 1 << 30:
        text += "; small for NCCL and DataLoader workers (docker run --shm-size)"
        return Row("/dev/shm", text, size, Status.NOTE)
    return Row("/dev/shm", text, size)


def _cpuinfo(root: Path) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (and Arm's machine-wide ones)."""
    fields: dict[str, str] = {}
    try:
        text = (root / "proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _torch_capability_rows() -> list[Row]:
    import torch  # lazily: the launcher's other paths never load it

    capability = torch.backends.cpu.get_cpu_capability()
    threads = torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS")
    return [
        Row("torch CPU kernels", f"{capability} (what ATen dispatches to)", capability),
        Row("torch threads", f"{threads} (OMP_NUM_THREADS={omp or 'unset'})", threads),
    ]


def _affinity_rows() -> list[Row]:
    cpus = sorted(os.sched_getaffinity(0))
    total = os.cpu_count() or len(cpus)
    status = Status.NOTE if len(cpus) < total else Status.OK
    text = f"{len(cpus)} of {total} CPUs: {cpu_ranges(cpus)}"
    return [Row("CPU affinity", text, cpus, status)]


def cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    spans: list[list[int]] = []
    for cpu in cpus:
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)

"""How much host memory this node has free for a job, as the job's surroundings limit it: one
function for the auto host budget (``runtime.planning.budgets``) and the environment report.

Available RAM is not the limit a container, a Kubernetes pod or a Slurm job runs under: the OOM
killer acts at the cgroup's limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), and Slurm
gives a job ``--mem`` (``SLURM_MEM_PER_NODE``) or ``--mem-per-cpu`` (``SLURM_MEM_PER_CPU`` times
``SLURM_CPUS_ON_NODE``), both in MiB. What is free is the smallest of:

- the RAM the kernel says is available;
- for each cgroup from this process's own up to the root, its limit less what it uses now
  (``memory.current`` / ``memory.usage_in_bytes``): in Kubernetes the process's own v2 group is
  often ``max`` and the pod's limit sits above it; v1 writes "no limit" as a page-rounded 2^63;
- Slurm's memory for this node less what this process holds (RSS) times the ranks on the node
  (the other ranks are alike).

Files are read from a root folder argument and the environment from a mapping, so tests hand in
their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

CGROUP_UNLIMITED = 1 << 62
"""cgroup v1 writes "no limit" as a page-rounded 2^63 - 1."""
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class HostSource:
    """One limit on the node's free host memory."""

    name: str
    """"available RAM", "cgroup", "Slurm"."""
    free_bytes: int | None
    """What it leaves free now; None: it sets no limit."""
    detail: str
    """Where the figure comes from, in words."""


def host_sources(
    *, root: Path = Path("/"), env: Mapping[str, str] | None = None, ranks_on_host: int = 1
) -> list[HostSource]:
    """Every limit found (see the module docstring), available RAM first."""
    env = os.environ if env is None else env
    available = psutil.virtual_memory().available
    sources = [HostSource("available RAM", available, "the kernel's MemAvailable")]
    sources.append(cgroup_source(root))
    sources.append(slurm_source(env, ranks_on_host=ranks_on_host))
    return sources


def free_host_bytes(
    *, root: Path = Path("/"), env: Mapping[str, str] | None = None, ranks_on_host: int = 1
) -> tuple[int, HostSource]:
    """The node's free host memory for this job: the smallest of ``host_sources``, and which."""
    sources = [s for s in host_sources(root=root, env=env, ranks_on_host=ranks_on_host) if s.free_bytes is not None]
    tightest = min(sources, key=lambda source: source.free_bytes or 0)
    assert tightest.free_bytes is not None
    return tightest.free_bytes, tightest


# ------------------------------------------------------------------------------------- cgroups


def cgroup_source(root: Path) -> HostSource:
    found = cgroup_headroom(root)
    if found is None:
        return HostSource("cgroup", None, "no memory cgroup (or not Linux)")
    headroom, limit, where = found
    if headroom is None:
        return HostSource("cgroup", None, f"unlimited ({where})")
    assert limit is not None
    return HostSource(
        "cgroup", headroom, f"{limit / 2**30:.2f} GiB limit, {headroom / 2**30:.2f} GiB of it free ({where})"
    )


def cgroup_limit(root: Path) -> tuple[int | None, str] | None:
    """(the smallest limit in bytes, None for unlimited; the file that set it, or the folder
    read); None when no memory cgroup is found."""
    found = cgroup_headroom(root)
    if found is None:
        return None
    _, limit, where = found
    return limit, where


def cgroup_headroom(root: Path) -> tuple[int | None, int | None, str] | None:
    """(the least any cgroup of this process leaves free, that cgroup's limit, its limit file)
    over the process's cgroup and its ancestors; (None, None, folder) when none is limited; None
    when there is no memory cgroup."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _tightest(root / "sys/fs/cgroup/memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes")
    for line in lines:
        if line.startswith("0::"):
            return _tightest(root / "sys/fs/cgroup", line[3:], "memory.max", "memory.current")
    return None


def _tightest(mount: Path, path: str, limit_name: str, usage_name: str) -> tuple[int | None, int | None, str] | None:
    """Walk from the process's cgroup folder up to the mount (a container sees its own cgroup as
    the root, so both the full path and the mount are tried)."""
    folder = mount / path.strip("/")
    if not folder.exists():
        folder = mount
    best: tuple[int, int, Path] | None = None  # (headroom, limit, file)
    seen = False
    while True:
        target = folder / limit_name
        if target.exists():
            seen = True
            text = target.read_text().strip()
            limit = None if text == "max" else int(text)
            if limit is not None and limit < CGROUP_UNLIMITED:
                usage = _read_int(folder / usage_name)
                headroom = max(0, limit - usage)
                if best is None or headroom < best[0]:
                    best = (headroom, limit, target)
        if folder == mount or mount not in folder.parents:
            break
        folder = folder.parent
    if not seen:
        return None
    if best is None:
        return None, None, f"{limit_name} under {mount}"
    return best[0], best[1], str(best[2])


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


# ------------------------------------------------------------------------------------- Slurm


def slurm_source(env: Mapping[str, str], *, ranks_on_host: int) -> HostSource:
    per_node = _mib(env.get("SLURM_MEM_PER_NODE"))
    if per_node is None:
        per_cpu, cpus = _mib(env.get("SLURM_MEM_PER_CPU")), _int(env.get("SLURM_CPUS_ON_NODE"))
        if per_cpu is None or cpus is None:
            return HostSource("Slurm", None, "no Slurm memory allocation")
        per_node, how = per_cpu * cpus, f"SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE ({cpus})"
    else:
        how = "SLURM_MEM_PER_NODE"
    held = psutil.Process().memory_info().rss * max(1, ranks_on_host)
    free = max(0, per_node - held)
    return HostSource("Slurm", free, f"{per_node / 2**30:.2f} GiB from {how}, {free / 2**30:.2f} GiB of it free")


def _mib(value: str | None) -> int | None:
    number = _int(value)
    return None if number is None or number <= 0 else number * MIB


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None

"""What held the device when a first-contact stage ran out of memory: the caching allocator's
reserved and allocated bytes, its segments, and the live blocks grouped by the first frame of
ours (or the model's) that allocated them, largest first. Printed to the run's log.

A stage that sets ``Section.record_memory`` runs with ``torch.cuda.memory._record_memory_history``
on (Python stacks only: cheap at the checkpoint stage's size), so each block has its stack; the
others get the segments and the block sizes alone.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

MIB = 1 << 20


_first_error: list[str] = []


def watch(*, record: bool) -> None:
    """Take the breakdown at the allocator's first out-of-memory error, before anything frees
    what held the device (an engine drops a failed window's gradients); ``record``: with stacks."""
    import torch

    if record:
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")

    def observe(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if not _first_error:
            _first_error.append(f"asked for {alloc / MIB:.2f} MiB\n" + breakdown())

    torch._C._cuda_attach_out_of_memory_observer(observe)


def at_first_error() -> str:
    """The breakdown taken at the first out-of-memory error, else one taken now."""
    return _first_error[0] if _first_error else breakdown()


def breakdown(top: int = 14) -> str:
    """Lines that say where the device's memory went (call right after the out-of-memory error)."""
    import torch

    stats = torch.cuda.memory_stats()
    lines = [
        "device memory at the error: "
        f"allocated {stats.get('allocated_bytes.all.current', 0) / MIB:.2f} MiB "
        f"(requested {stats.get('requested_bytes.all.current', 0) / MIB:.2f}), "
        f"reserved {stats.get('reserved_bytes.all.current', 0) / MIB:.2f} MiB in "
        f"{stats.get('segment.all.current', 0)} segments, "
        f"peak allocated {stats.get('allocated_bytes.all.peak', 0) / MIB:.2f} MiB"
    ]
    snapshot: dict[str, Any] = torch.cuda.memory._snapshot()
    segments = snapshot.get("segments", [])
    sizes = Counter(f"{seg['total_size'] / MIB:.2f}" for seg in segments)
    lines.append("segments (MiB x count): " + ", ".join(f"{s} x{n}" for s, n in sizes.most_common()))
    by_site: dict[str, list[int]] = defaultdict(list)
    for segment in segments:
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            by_site[_site(block.get("frames", []))].append(int(block.get("requested_size", block["size"])))
    ranked = sorted(by_site.items(), key=lambda item: -sum(item[1]))
    for site, blocks in ranked[:top]:
        total, largest = sum(blocks) / MIB, max(blocks) / MIB
        lines.append(f"  {total:8.2f} MiB in {len(blocks):4d} blocks (largest {largest:.2f}) {site}")
    return "\n".join(lines)


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch itself, with the torch call just below it."""
    inner = ""
    for frame in frames:
        name = frame.get("filename", "")
        if "/torch/" in name and "/protrain/" not in name:
            inner = inner or f"{name.rsplit('/', 1)[-1]}:{frame.get('name', '')}"
            continue
        where = f"{name.rsplit('/', 2)[-2:]}" if "/" in name else name
        return f"{where}:{frame.get('line', '')} {frame.get('name', '')}" + (f" [{inner}]" if inner else "")
    return inner or "(no Python frame: allocated by a library)"

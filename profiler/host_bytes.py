"""The host memory chunk state takes, counted exactly: shared by the cost model and the runtime.

Pure functions (no torch), as profiler/chunking.py is for the packing: the runtime sizes its host
regions with them (runtime/chunks/store.py, staging.py, optimizer.py) and the cost model predicts
with them, so the planner's host figure is what the process maps, to the byte (checked by
tests/unit/test_host_bytes.py against the live regions at every hook).

What one rank holds in host memory for an offloaded chunk (padding exists only in the device
buffers and the collectives: parameters are packed from offset 0, so a rank's real elements are
the prefix of its shard, ``rank_numel`` of them):

    trainable   fp32 master + two fp32 Adam moments                         12 bytes per element
                + an fp32 gradient shard when gradients must be kept          4 bytes per element
                  (``keeps_gradients``: clipping or fp16 wait for the global norm, accumulation
                  sums several micro-batches); otherwise each reduced gradient is applied by
                  CPU Adam as it arrives, from the staging buffer it landed in
    frozen      the shard in the compute dtype

each tensor at ``HOST_ALIGN_BYTES``, the region rounded up to a page. Beside them, fixed staging
(``staging_bytes``): two buffers of a shard in the compute dtype for reduced gradients (three
where fp32 gradients are applied as they arrive: CPU Adam reads the buffer itself), two for
uploads when the compute dtype is not fp32 (masters are downcast into them), and, when gradients
are applied as they arrive in a dtype other than fp32, one fp32 shard they are widened into (when
kept, a slice of ``WIDEN_SLICE_NUMEL`` elements: gradients are widened before each add). At
most three fp32 shards in all.
"""

from __future__ import annotations

import mmap

PAGE_BYTES = mmap.PAGESIZE
HOST_ALIGN_BYTES = 64
"""Alignment of each chunk-state tensor in its region: a cache line (vector loads and the fused
CPU Adam want aligned rows; pages would waste up to 4 KiB per tensor for nothing)."""
STAGING_BUFFERS = 2
"""Per staging ring: one buffer being filled while the previous one is read."""
FP32_BYTES = 4
ADAMW_STATES = 2
"""fp32 state tensors per trainable element of the default optimizer rule (AdamW's moments);
other rules pass their own count (runtime/optim/)."""
WIDEN_SLICE_NUMEL = 1 << 20
"""Elements of the fp32 scratch a 16-bit gradient is widened into, slice by slice, before the
host worker adds it into a kept fp32 gradient shard (runtime/chunks/grad_add.py)."""


NVME_SLOTS = 3
"""Host slots the NVMe tier's chunk states pass through (memory.ssd.n_optimizer): one being read
ahead, one being updated, one being written behind."""
NVME_GRADIENT_BUFFERS = 2
"""Host buffers the kept gradients of NVMe chunks pass through (runtime/chunks/nvme_grads.py): one
being added into while the other is written behind."""
NVME_BLOCK_BYTES = 4096
"""O_DIRECT alignment of the NVMe tier's file offsets and lengths (runtime/hw/ssd_io.py)."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def rank_numel(used: int, shard_numel: int, rank: int) -> int:
    """Real elements of a chunk (``used`` from offset 0) in ``rank``'s shard."""
    return min(max(used - rank * shard_numel, 0), shard_numel)


def tensor_bytes(numel: int, element_size: int) -> int:
    """One chunk-state tensor's place in its region."""
    return round_up(numel * element_size, HOST_ALIGN_BYTES)


def chunk_state_bytes(
    numel: int,
    *,
    trainable: bool,
    element_size: int,
    keeps_gradients: bool,
    optimizer_states: int = ADAMW_STATES,
    on_nvme: bool = False,
) -> int:
    """One offloaded chunk's host state on a rank holding ``numel`` of its elements: trainable,
    its fp32 master, the optimizer's ``optimizer_states`` tensors and (kept) its gradient. A
    chunk whose state is ``on_nvme`` keeps its optimizer state and its kept gradient in files,
    and in a compute dtype other than fp32 its master too, holding its compute copy instead
    (``nvme_tensors``)."""
    if not trainable:
        return tensor_bytes(numel, element_size)
    if on_nvme:
        return tensor_bytes(numel, element_size)  # the master in fp32, else the compute copy
    gradient = tensor_bytes(numel, FP32_BYTES) if keeps_gradients else 0
    return (1 + optimizer_states) * tensor_bytes(numel, FP32_BYTES) + gradient


def nvme_tensors(optimizer_states: int, element_size: int) -> int:
    """fp32 tensors an NVMe chunk keeps in its file: the optimizer's state and, in a compute
    dtype other than fp32, the master (the host keeps the compute copy forward uploads; in fp32
    the master is that copy and stays)."""
    return optimizer_states + (1 if element_size != FP32_BYTES else 0)


def nvme_positions(trainable: list[bool], n_nvme: int) -> set[int]:
    """Which of the offloaded chunks (``trainable`` flags, in chunk order) keep their optimizer
    state on NVMe: the last ``n_nvme`` trainable ones."""
    positions = [position for position, flag in enumerate(trainable) if flag]
    return set(positions[len(positions) - n_nvme :]) if n_nvme > 0 else set()


def nvme_tensor_bytes(numel: int) -> int:
    """One state tensor of ``numel`` fp32 elements in an NVMe state file (and in a host slot)."""
    return round_up(numel * FP32_BYTES, NVME_BLOCK_BYTES)


def nvme_file_bytes(numel: int, tensors: int) -> int:
    """A chunk's NVMe state file on a rank holding ``numel`` of its elements (``nvme_tensors``)."""
    return tensors * nvme_tensor_bytes(numel)


def nvme_slot_bytes(shard_numel: int, tensors: int, *, n_nvme: int) -> int:
    """The host slots NVMe chunk states (``nvme_tensors`` each) are read into, updated in and
    written from (none without an NVMe chunk)."""
    if n_nvme <= 0 or tensors <= 0:
        return 0
    return region_bytes(min(NVME_SLOTS, n_nvme) * tensors * nvme_tensor_bytes(shard_numel))


def nvme_gradient_bytes(shard_numel: int, *, n_nvme: int, keeps_gradients: bool) -> int:
    """The host buffers NVMe chunks' kept gradients pass through (none when gradients are
    applied as they arrive, or without an NVMe chunk)."""
    if n_nvme <= 0 or not keeps_gradients:
        return 0
    return region_bytes(min(NVME_GRADIENT_BUFFERS, n_nvme) * nvme_tensor_bytes(shard_numel))


def region_bytes(payload: int) -> int:
    """What a region holding ``payload`` bytes maps (whole pages, at least one)."""
    return round_up(max(payload, PAGE_BYTES), PAGE_BYTES)


def ring_bytes(numel: int, element_size: int, count: int = STAGING_BUFFERS) -> int:
    """A staging ring of ``count`` page-aligned buffers of ``numel`` elements."""
    return region_bytes(count * round_up(numel * element_size, PAGE_BYTES))


def gradient_staging_buffers(element_size: int, *, keeps_gradients: bool) -> int:
    """Buffers of the reduced-gradient ring: two, or three where CPU Adam reads an fp32 gradient
    straight from its buffer (applied as it arrives) and so holds it for the update's length."""
    return STAGING_BUFFERS + (1 if not keeps_gradients and element_size == FP32_BYTES else 0)


def staging_bytes(
    shard_numel: int, *, element_size: int, offloaded_trainable: bool, keeps_gradients: bool, downcasts: bool = True
) -> int:
    """The fixed staging regions beside the chunk state (none without an offloaded trainable
    chunk: frozen shards go up as they are stored). ``downcasts``: some offloaded chunk keeps
    its fp32 master on the host (not every one's is on NVMe), so uploads downcast it."""
    if not offloaded_trainable:
        return 0
    gradients = gradient_staging_buffers(element_size, keeps_gradients=keeps_gradients)
    total = ring_bytes(shard_numel, element_size, gradients)  # reduced gradients, device -> host
    if element_size != FP32_BYTES:
        if downcasts:
            total += ring_bytes(shard_numel, element_size)  # fp32 masters downcast for upload
        # A gradient widened whole for CPU Adam, or slice by slice before its add.
        widened = shard_numel if not keeps_gradients else min(shard_numel, WIDEN_SLICE_NUMEL)
        total += region_bytes(widened * FP32_BYTES)
    return total


def offloaded_region_bytes(
    chunks: list[tuple[int, bool]],
    shard_numel: int,
    *,
    element_size: int,
    keeps_gradients: bool,
    optimizer_states: int = ADAMW_STATES,
    n_nvme: int = 0,
) -> int:
    """What rank 0 (which holds the most) maps for the offloaded ``chunks`` ((used elements,
    trainable) each): their state's region and the staging regions, as the runtime sizes them.
    ``n_nvme``: of them, the last trainable ones whose optimizer state (and kept gradient) is in
    files (their slots and gradient buffers counted instead)."""
    if not chunks:
        return 0
    on_nvme = nvme_positions([trainable for _, trainable in chunks], n_nvme)
    payload = sum(
        chunk_state_bytes(
            rank_numel(used, shard_numel, 0),
            trainable=trainable,
            element_size=element_size,
            keeps_gradients=keeps_gradients,
            optimizer_states=optimizer_states,
            on_nvme=position in on_nvme,
        )
        for position, (used, trainable) in enumerate(chunks)
    )
    slots = nvme_slot_bytes(shard_numel, nvme_tensors(optimizer_states, element_size), n_nvme=len(on_nvme))
    slots += nvme_gradient_bytes(shard_numel, n_nvme=len(on_nvme), keeps_gradients=keeps_gradients)
    return (
        region_bytes(payload)
        + slots
        + staging_bytes(
            shard_numel,
            element_size=element_size,
            offloaded_trainable=any(trainable for _, trainable in chunks),
            keeps_gradients=keeps_gradients,
            downcasts=sum(trainable for _, trainable in chunks) > len(on_nvme),
        )
    )


def checkpoint_staging_bytes(
    param_sizes: list[tuple[int, bool]], *, element_size: int, world_size: int, optimizer_states: int = ADAMW_STATES
) -> int:
    """What an asynchronous save copies to host memory on a rank before writing in the
    background: its share of every parameter's fp32 master and the optimizer's state tensors
    (trainable), or of its stored copy (frozen)."""
    trained = (1 + optimizer_states) * FP32_BYTES
    total = sum(numel * (trained if trainable else element_size) for numel, trainable in param_sizes)
    return -(-total // max(1, world_size))

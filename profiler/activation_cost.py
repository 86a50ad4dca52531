"""Predicted cost of the block-wise activation modes: the time they add to a step and the saved
activation bytes alive at the device peak. Pure functions over saved profiles; no torch.

Per block ``i`` (forward ``f``, backward ``b``, saved bytes ``a``, input bytes ``x``)::

    keep        a alive from the block's forward to its backward
    checkpoint  only x alive; backward recomputes the forward first (+f) and holds a meanwhile
    swap        a copied to host after the block's forward (a / d2h), back before its backward
                (a / h2d); nothing alive in between
    ssd         a written to disk after the block's forward (a / ssd_write), read back before its
                backward (a / ssd_read); nothing alive in between

Transfers are simulated on one channel per tier (the copy engine, the drive), in block order:
forward issues block i's copy when its forward ends; backward issues the copy back of block i when
the backward of the ``PREFETCH_BLOCKS``-th offloaded block after it starts (the first ones at the
start of backward), and waits for it before block i's backward. What the channel has not finished
by the end of forward, and every wait in backward, is exposed time. On a machine whose copies do
not overlap compute (CPU: ``copies_overlap_compute`` False), a swap is a memcpy on the compute
cores and adds in full; disk I/O waits for the drive and is simulated like on a GPU.

Device peak of the activations: the larger of the end of forward (kept blocks' bytes, checkpoint
inputs, everything outside the blocks) and, at each block's backward, the bytes alive below it plus
its own restored or recomputed bytes plus the prefetched bytes of the next offloaded blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from profiler.profile import HardwareProfile, ModelProfile

KEEP, SWAP, CHECKPOINT, SSD = "keep", "swap", "checkpoint", "ssd"
MODES = (KEEP, SWAP, CHECKPOINT, SSD)
OFFLOADED = (SWAP, SSD)
PREFETCH_BLOCKS = 2
"""Offloaded blocks the activation manager reads ahead of the backward that needs them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationCost:
    forward_extra_s: float
    """Transfer time that forward does not hide (CPU swap copies in full)."""
    backward_extra_s: float
    """Recomputation plus waits for activations coming back."""
    peak_bytes: int
    """Saved activations alive at their device peak (bytes per rank)."""
    host_bytes: int
    """Host memory holding swapped blocks."""
    ssd_bytes: int
    """Bytes written to disk per micro-batch (and read back)."""


def activation_cost(model: ModelProfile, hardware: HardwareProfile, modes: Sequence[str]) -> ActivationCost:
    """Time and memory of the per-block ``modes`` (values of ``MODES``; ``BlockMode`` members
    compare equal to them) on ``model`` and ``hardware``."""
    blocks = model.blocks
    if len(modes) != len(blocks):
        raise ValueError(f"{len(modes)} block modes for a model of {len(blocks)} blocks")
    unknown = sorted({str(mode) for mode in modes if mode not in MODES})
    if unknown:
        raise ValueError(f"unknown block modes {unknown}; allowed: {', '.join(MODES)}")
    if SSD in modes and not (hardware.ssd_write_bytes_per_s > 0 and hardware.ssd_read_bytes_per_s > 0):
        raise ValueError("ssd blocks need the disk's measured rates (memory.ssd.path); this profile has none")
    saved = [block.activation_bytes for block in blocks]
    alive = [
        _alive_after_forward(mode, block.activation_bytes, block.input_bytes)
        for mode, block in zip(modes, blocks, strict=True)
    ]

    forward_extra = _forward_exposed(model, hardware, modes, saved)
    backward_extra = 0.0
    for mode, block in zip(modes, blocks, strict=True):
        if mode == CHECKPOINT:
            backward_extra += block.forward_s
        elif mode == SWAP and not hardware.copies_overlap_compute:
            backward_extra += block.activation_bytes / hardware.h2d_bytes_per_s
    backward_extra += _backward_waits(model, hardware, modes, saved)

    peak = below = model.other_activation_bytes + sum(alive)  # the end of forward
    for index in reversed(range(len(blocks))):
        below -= alive[index]
        ahead = [i for i in range(index - 1, -1, -1) if modes[i] in OFFLOADED][:PREFETCH_BLOCKS]
        peak = max(peak, below + saved[index] + sum(saved[i] for i in ahead))
    return ActivationCost(
        forward_extra_s=forward_extra,
        backward_extra_s=backward_extra,
        peak_bytes=peak,
        host_bytes=sum(a for a, mode in zip(saved, modes, strict=True) if mode == SWAP),
        ssd_bytes=sum(a for a, mode in zip(saved, modes, strict=True) if mode == SSD),
    )


def _alive_after_forward(mode: str, saved: int, inputs: int) -> int:
    if mode == KEEP:
        return saved
    if mode == CHECKPOINT:
        return inputs
    return 0


def _rates(hardware: HardwareProfile, mode: str) -> tuple[float, float]:
    """(out, back) bytes per second of the tier ``mode`` sends activations to."""
    if mode == SWAP:
        return hardware.d2h_bytes_per_s, hardware.h2d_bytes_per_s
    return hardware.ssd_write_bytes_per_s, hardware.ssd_read_bytes_per_s


def _channels(hardware: HardwareProfile) -> tuple[str, ...]:
    """Tiers whose transfers run beside compute (simulated); CPU swaps are memcpys in line."""
    return (SWAP, SSD) if hardware.copies_overlap_compute else (SSD,)


def _forward_exposed(
    model: ModelProfile, hardware: HardwareProfile, modes: Sequence[str], saved: Sequence[int]
) -> float:
    exposed = 0.0
    if not hardware.copies_overlap_compute:
        exposed += sum(
            a / hardware.d2h_bytes_per_s for a, mode in zip(saved, modes, strict=True) if mode == SWAP
        )
    for channel in _channels(hardware):
        out_rate, _ = _rates(hardware, channel)
        now = 0.0
        busy_until = 0.0
        for mode, block, nbytes in zip(modes, model.blocks, saved, strict=True):
            now += block.forward_s
            if mode == channel:
                busy_until = max(busy_until, now) + nbytes / out_rate
        # The head and the loss run after the last block: more room to finish the writes.
        exposed += max(0.0, busy_until - now - model.other_forward_s)
    return exposed


def _backward_waits(
    model: ModelProfile, hardware: HardwareProfile, modes: Sequence[str], saved: Sequence[int]
) -> float:
    return sum(_channel_waits(model, hardware, modes, saved, channel) for channel in _channels(hardware))


def _channel_waits(
    model: ModelProfile, hardware: HardwareProfile, modes: Sequence[str], saved: Sequence[int], channel: str
) -> float:
    """Seconds backward waits for the blocks sent to ``channel``: reads of the first
    ``PREFETCH_BLOCKS`` of them (in backward order) start when backward begins; reaching the one
    at position p issues the reads up to position p + ``PREFETCH_BLOCKS``; the channel serves
    reads one after another."""
    _, back_rate = _rates(hardware, channel)
    order = list(reversed(range(len(modes))))
    offloaded = [i for i in order if modes[i] == channel]
    ready: list[float] = []  # when each issued read completes, by position
    busy_until = 0.0
    waits = 0.0
    now = model.other_backward_s
    for index in order:
        if modes[index] == channel:
            position = offloaded.index(index)
            at_start = len(ready) == 0
            last = min(position + PREFETCH_BLOCKS, len(offloaded) - 1)
            while len(ready) <= last:
                # The first reads were issued when backward began (time 0), the rest now.
                issued_at = 0.0 if at_start and len(ready) < PREFETCH_BLOCKS else now
                busy_until = max(busy_until, issued_at) + saved[offloaded[len(ready)]] / back_rate
                ready.append(busy_until)
            wait = max(0.0, ready[position] - now)
            waits += wait
            now += wait
        now += model.blocks[index].backward_s
        if modes[index] == CHECKPOINT:
            now += model.blocks[index].forward_s
    return waits

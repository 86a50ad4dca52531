"""Predicted cost of the block-wise activation modes: the time they add to a step and the saved
activation bytes alive at the device peak. Pure functions over saved profiles; no torch.

Per block ``i`` (forward ``f``, backward ``b``, saved bytes ``a``, input bytes ``x``)::

    keep        a alive from the block's forward to its backward
    checkpoint  only x alive; backward recomputes the forward first (+f) and holds a meanwhile,
                and a private copy of the block's parameters (those in buffer slots, which
                other chunks may take over before the block's backward ends: counted for all,
                a bound)
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

Forward waits, at the end of each offloaded block, for the blocks before it to have left the
device, so at most two consecutive offloaded blocks' bytes are in flight. Device peak of the
activations: the larger of forward's (kept blocks' bytes, checkpoint inputs, everything outside
the blocks, and those bytes in flight) and, at each block's backward, the bytes alive below it plus
its own restored or recomputed bytes plus the prefetched bytes of the next offloaded blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protrain.profiler.profile import HardwareProfile, ModelProfile

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

    weights = _block_parameter_bytes(model)
    below = model.other_activation_bytes + sum(alive)
    peak = below + _in_flight_bytes(modes, saved)  # forward, up to its end
    # Offloaded blocks below each block, nearest first: the ones its backward has prefetched.
    offloaded_below: list[int] = [i for i, mode in enumerate(modes) if mode in OFFLOADED]
    for index in reversed(range(len(blocks))):
        below -= alive[index]
        while offloaded_below and offloaded_below[-1] >= index:
            offloaded_below.pop()
        ahead = offloaded_below[-PREFETCH_BLOCKS:]
        copies = weights[index] if modes[index] == CHECKPOINT else 0
        peak = max(peak, below + saved[index] + copies + sum(saved[i] for i in ahead))
    return ActivationCost(
        forward_extra_s=forward_extra,
        backward_extra_s=backward_extra,
        peak_bytes=peak,
        host_bytes=sum(a for a, mode in zip(saved, modes, strict=True) if mode == SWAP),
        ssd_bytes=sum(a for a, mode in zip(saved, modes, strict=True) if mode == SSD),
    )


def _in_flight_bytes(modes: Sequence[str], saved: Sequence[int]) -> int:
    """The most offloaded bytes still on the device in forward: the runtime waits, at the end of
    each offloaded block, for the blocks before it to have left, so at most two consecutive
    blocks' bytes are in flight (one's copies while the next one runs and saves)."""
    offloaded = [a if mode in OFFLOADED else 0 for a, mode in zip(saved, modes, strict=True)]
    return max((before + now for before, now in zip([0, *offloaded], offloaded, strict=False)), default=0)


def _block_parameter_bytes(model: ModelProfile) -> list[int]:
    """Per block, its parameters' bytes in the compute dtype."""
    weights = [0] * len(model.blocks)
    for (numel, _), block in zip(model.param_sizes, model.param_block, strict=True):
        if 0 <= block < len(weights):
            weights[block] += numel * model.element_size
    return weights


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
    return hardware.ssd_rates()


def _channels(hardware: HardwareProfile) -> tuple[str, ...]:
    """Tiers whose transfers run beside compute (simulated); CPU swaps are memcpys in line."""
    return (SWAP, SSD) if hardware.copies_overlap_compute else (SSD,)


def _forward_exposed(
    model: ModelProfile, hardware: HardwareProfile, modes: Sequence[str], saved: Sequence[int]
) -> float:
    exposed = 0.0
    if not hardware.copies_overlap_compute:
        exposed += sum(a / hardware.d2h_bytes_per_s for a, mode in zip(saved, modes, strict=True) if mode == SWAP)
    busy_until = dict.fromkeys(_channels(hardware), 0.0)
    staged_until = 0.0  # overlapping copies: when the copy engine has taken the bytes off the device
    landed_before = 0.0  # when the offloaded blocks so far have all left the device
    now = 0.0
    for mode, block, nbytes in zip(modes, model.blocks, saved, strict=True):
        now += block.forward_s
        if mode not in OFFLOADED:
            continue
        # The end of an offloaded block waits for the blocks before it to have left the device.
        waited = max(0.0, landed_before - now)
        exposed += waited
        now += waited
        if mode in busy_until:
            out_rate, _ = _rates(hardware, mode)
            busy_until[mode] = max(busy_until[mode], now) + nbytes / out_rate
        if hardware.copies_overlap_compute:  # swaps, and ssd staging in host memory (CUDA)
            staged_until = max(staged_until, now) + nbytes / hardware.d2h_bytes_per_s
            landed_before = staged_until
        elif mode in busy_until:  # ssd on CPU: the bytes leave once written (a swap is in line)
            landed_before = max(landed_before, busy_until[mode])
    # The head and the loss run after the last block: more room to finish the writes.
    exposed += sum(max(0.0, busy - now - model.other_forward_s) for busy in busy_until.values())
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
    position = -1
    for index in order:
        if modes[index] == channel:
            position += 1
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


def block_layout(num_blocks: int, *, n_offload: int, n_swap: int, n_checkpoint: int) -> tuple[str, ...]:
    """DESIGN section 4's order: ssd blocks first, then swap blocks with checkpoint blocks
    interleaved among them, kept blocks last (backward consumes those first)."""
    if min(n_offload, n_swap, n_checkpoint) < 0 or n_offload + n_swap + n_checkpoint > num_blocks:
        raise ValueError(
            f"ssd.n_offload + n_swap + n_checkpoint = {n_offload + n_swap + n_checkpoint} must be between "
            f"0 and the model's {num_blocks} blocks"
        )
    # Spread checkpoint blocks evenly among the swap blocks so un-swapped activations do not
    # pile up in one place; leftover checkpoint blocks follow.
    interleaved: list[str] = []
    remaining = n_checkpoint
    for index in range(n_swap):
        interleaved.append(SWAP)
        take = -(-remaining // (n_swap - index))
        interleaved.extend([CHECKPOINT] * take)
        remaining -= take
    interleaved.extend([CHECKPOINT] * remaining)
    layout = [SSD] * n_offload + interleaved
    return tuple(layout + [KEEP] * (num_blocks - len(layout)))


GRID_STEPS = 10
"""Values per activation count the search tries (0 .. L in about this many steps; every count
when the model has no more blocks than this)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationOption:
    modes: tuple[str, ...]
    cost: ActivationCost


def count_grid(num_blocks: int, fixed: int | None, *, allowed: bool = True, steps: int = GRID_STEPS) -> list[int]:
    """The counts tried for one knob: the hand-set value, 0 when the tier is unavailable, else
    0 .. num_blocks in at most ``steps`` strides (both ends included)."""
    if fixed is not None:
        return [fixed]
    if not allowed or num_blocks == 0:
        return [0]
    stride = max(1, -(-num_blocks // steps))
    values = list(range(0, num_blocks + 1, stride))
    return values if values[-1] == num_blocks else [*values, num_blocks]


def activation_options(
    model: ModelProfile,
    hardware: HardwareProfile,
    *,
    n_swap: int | None = None,
    n_checkpoint: int | None = None,
    n_offload: int | None = None,
    ssd: bool = False,
    steps: int = GRID_STEPS,
) -> list[ActivationOption]:
    """The layouts worth predicting: every combination of the counts on their grids (hand-set
    counts fixed; ssd only when ``ssd``, i.e. a path is set and the disk was measured), minus
    those another layout beats on every axis (forward and backward extra time, device peak, host
    bytes): a dominated layout is never in the fastest plan that fits. Fastest first."""
    num_blocks = len(model.blocks)
    options: list[ActivationOption] = []
    for offload in count_grid(num_blocks, n_offload, allowed=ssd, steps=steps):
        for swap in count_grid(num_blocks, n_swap, steps=steps):
            for checkpoint in count_grid(num_blocks, n_checkpoint, steps=steps):
                if offload + swap + checkpoint > num_blocks:
                    continue
                modes = block_layout(num_blocks, n_offload=offload, n_swap=swap, n_checkpoint=checkpoint)
                options.append(ActivationOption(modes=modes, cost=activation_cost(model, hardware, modes)))
    if not options:
        raise ValueError(f"ssd.n_offload + n_swap + n_checkpoint set by hand exceed the model's {num_blocks} blocks")
    return _undominated(options)


def _undominated(options: list[ActivationOption]) -> list[ActivationOption]:
    def key(option: ActivationOption) -> tuple[float, float, int, int]:
        cost = option.cost
        return (cost.forward_extra_s, cost.backward_extra_s, cost.peak_bytes, cost.host_bytes)

    kept: list[ActivationOption] = []
    for option in sorted(options, key=lambda o: (sum(key(o)[:2]), key(o))):
        mine = key(option)
        if not any(all(theirs <= ours for theirs, ours in zip(key(other), mine, strict=True)) for other in kept):
            kept.append(option)
    return kept

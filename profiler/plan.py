"""The Plan: the frozen contract between the planner and the runtime engine.

It holds the knobs (chunk size, ``n_persist``, ``n_buffer``, ``n_swap``, ``n_checkpoint``,
``n_offload``) and one activation mode per transformer block, plus what the planner predicted.
The chunk layout itself is a runtime value (saved with checkpoints), not part of the plan.

Plain values only, so a plan can be saved, compared and printed; ``to_dict``/``from_dict``
round-trip exactly. This module imports nothing of ours and not torch: the spec reads
``BlockMode`` from here without loading the search. What builds plans (the resident rule, the
searched plan) is ``profiler/plan_builder.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

PLAN_VERSION = 1


class BlockMode(str, Enum):
    """What happens to one transformer block's saved activations between forward and backward."""

    KEEP = "keep"
    SWAP = "swap"
    CHECKPOINT = "checkpoint"
    SSD = "ssd"


class UpdateMode(str, Enum):
    """How the optimizer updates offloaded chunks (runtime/chunks/optimizer.py), which follows
    from whether a window's update needs the global gradient norm first (clipping, fp16) and
    whether host work runs beside compute (CUDA) or on its cores (CPU):

    - ``on_arrival``: no norm, no accumulation: offloaded chunks keep no gradient shard; each
      reduced gradient is applied as it arrives, during the last backward;
    - ``early``: no norm: each offloaded chunk is updated during the window's last backward, as
      soon as its gradient is complete;
    - ``two_phase``: a norm, host beside compute: the last backward takes each shard's squared
      norm; the step queues the updates, which overlap the next forward;
    - ``deferred``: a norm, on CPU: every update at the step.
    """

    ON_ARRIVAL = "on_arrival"
    EARLY = "early"
    TWO_PHASE = "two_phase"
    DEFERRED = "deferred"

    @classmethod
    def of(cls, *, keeps_gradients: bool, updates_after_norm: bool, host_beside_compute: bool) -> UpdateMode:
        """The mode a job's settings and device call for (docs/decisions/0001-offloaded-update-modes.md)."""
        if updates_after_norm:
            return cls.TWO_PHASE if host_beside_compute else cls.DEFERRED
        return cls.EARLY if keeps_gradients else cls.ON_ARRIVAL

    @property
    def keeps_gradients(self) -> bool:
        """Offloaded chunks keep an fp32 gradient shard (all but ``on_arrival``)."""
        return self is not UpdateMode.ON_ARRIVAL

    @property
    def updates_after_norm(self) -> bool:
        """The update waits for the window's global gradient norm."""
        return self in (UpdateMode.TWO_PHASE, UpdateMode.DEFERRED)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Knobs and per-block modes for one job, the same on every rank."""

    version: int = PLAN_VERSION
    world_size: int
    micro_batch_size: int
    precision: str
    chunk_size: int
    """Bytes per model-state chunk."""
    num_chunks: int
    n_persist: int
    """The first n_persist chunks (execution order) stay on the device."""
    n_buffer: int
    """Device chunk buffers for the other chunks."""
    n_replicate: int = 0
    """Of the persistent chunks, the first n_replicate are replicated on every rank (their
    gradients all-reduced, their whole state on each rank, as DDP) instead of sharded."""
    n_swap: int
    n_checkpoint: int
    n_offload: int
    """Blocks whose activations go to the SSD tier."""
    n_optimizer: int = 0
    """The last offloaded chunks holding trainable parameters whose optimizer state lives in
    files under memory.ssd.path (the NVMe tier) instead of host memory."""
    block_modes: tuple[BlockMode, ...]
    device_budget_bytes: int
    host_budget_bytes: int
    chosen: tuple[str, ...] = ()
    """Spec key paths that were "auto" and were filled by this plan."""
    rule: str = ""
    """How the auto knobs were filled, in words."""
    predicted_step_s: float | None = None
    predicted_compute_s: float | None = None
    """Of the predicted step, one micro-batch's forward and backward (the transfers they cannot
    hide included, not the update): what the stale-profile check compares, since a busy host
    moves the rest of the step (CPU Adam, the update) and not the profile's compute."""
    predicted_peak_device_bytes: int | None = None
    predicted_peak_host_bytes: int | None = None
    """What a rank's process holds in host memory at its peak: the plan's host regions (chunk
    state, staging, swapped activations) and ``host_fixed_bytes``."""
    host_fixed_bytes: int = 0
    """Host memory beside what the plan places: the process's own at start (the interpreter,
    torch, what the caller holds) less the parameters the chunks take over, and an asynchronous
    save's staging."""
    predicted_ssd_bytes: int | None = None
    predicted_nvme_bytes: int | None = None
    """Optimizer state on NVMe per rank (``n_optimizer``): also what each update writes there."""
    notes: tuple[str, ...] = field(default=())
    update_mode: UpdateMode = UpdateMode.EARLY
    """How offloaded chunks are updated (``UpdateMode``)."""
    batch_shape: tuple[int, ...] = ()
    """The profiled batch's main input shape: the plan's predictions hold for no larger batch
    (empty: made without a profile)."""

    def __post_init__(self) -> None:
        if self.n_persist > self.num_chunks:
            raise ValueError(f"n_persist ({self.n_persist}) exceeds the number of chunks ({self.num_chunks})")
        if not 0 <= self.n_replicate <= self.n_persist:
            raise ValueError(f"n_replicate ({self.n_replicate}) must be within [0, n_persist={self.n_persist}]")
        if not 0 <= self.n_optimizer <= self.num_chunks - self.n_persist:
            offloaded = self.num_chunks - self.n_persist
            raise ValueError(f"n_optimizer ({self.n_optimizer}) must be within [0, the {offloaded} offloaded chunks]")
        counted = {
            BlockMode.SWAP: self.n_swap,
            BlockMode.CHECKPOINT: self.n_checkpoint,
            BlockMode.SSD: self.n_offload,
        }
        for mode, count in counted.items():
            if self.block_modes.count(mode) != count:
                raise ValueError(
                    f"block_modes lists {self.block_modes.count(mode)} {mode.value} blocks, plan says {count}"
                )

    def _replicated_words(self) -> str:
        """The plan table's n_replicate: "as DDP" when every chunk is replicated on several ranks."""
        if self.world_size > 1 and self.n_replicate == self.num_chunks:
            return f"{self.n_replicate} (all: as DDP)"
        return str(self.n_replicate)

    def _nvme_write_words(self) -> str | None:
        """What the NVMe state writes per update and per day of updates (SSDs wear)."""
        if not self.predicted_nvme_bytes:
            return None
        words = f"{format_bytes(self.predicted_nvme_bytes)} per update"
        if self.predicted_step_s:
            daily = self.predicted_nvme_bytes * 86_400 / self.predicted_step_s
            words += f", {format_bytes(int(daily))} per day"
        return words

    @property
    def num_blocks(self) -> int:
        return len(self.block_modes)

    @property
    def all_resident(self) -> bool:
        """Every chunk persistent and every block kept: nothing leaves the device."""
        return self.n_persist >= self.num_chunks and all(m is BlockMode.KEEP for m in self.block_modes)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["block_modes"] = [mode.value for mode in self.block_modes]
        body["update_mode"] = self.update_mode.value
        body["chosen"] = list(self.chosen)
        body["notes"] = list(self.notes)
        body["batch_shape"] = list(self.batch_shape)
        return body

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Plan:
        if body.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {body.get('version')!r} is not {PLAN_VERSION}")
        known = {f.name for f in fields(cls)}
        unknown = set(body) - known
        if unknown:
            raise ValueError(f"unknown plan fields: {sorted(unknown)}")
        values = dict(body)
        values["block_modes"] = tuple(BlockMode(mode) for mode in body["block_modes"])
        values["update_mode"] = UpdateMode(body.get("update_mode", UpdateMode.EARLY.value))
        values["chosen"] = tuple(body.get("chosen", ()))
        values["notes"] = tuple(body.get("notes", ()))
        values["batch_shape"] = tuple(body.get("batch_shape", ()))
        return cls(**values)

    def rows(self) -> list[tuple[str, str, str]]:
        """(knob, value, where it came from) for a table."""

        def origin(key: str) -> str:
            return "auto" if key in self.chosen else "spec"

        modes = ", ".join(f"{count}x{mode}" for mode, count in _run_lengths(self.block_modes))
        rows = [
            ("world_size", str(self.world_size), "launch"),
            ("micro_batch_size", str(self.micro_batch_size), "spec"),
            ("precision", self.precision, "spec"),
            ("device_budget", format_bytes(self.device_budget_bytes), origin("memory.device_budget")),
            ("host_budget", format_bytes(self.host_budget_bytes), origin("memory.host_budget")),
            ("chunk_size", format_bytes(self.chunk_size), origin("memory.chunk_size")),
            ("chunks", str(self.num_chunks), "model"),
            ("n_persist", str(self.n_persist), origin("memory.n_persist")),
            ("n_buffer", str(self.n_buffer), origin("memory.n_buffer")),
            ("n_replicate", self._replicated_words(), origin("memory.n_replicate")),
            ("n_swap", str(self.n_swap), origin("memory.n_swap")),
            ("n_checkpoint", str(self.n_checkpoint), origin("memory.n_checkpoint")),
            ("ssd.n_offload", str(self.n_offload), origin("memory.ssd.n_offload")),
            ("ssd.n_optimizer", str(self.n_optimizer), origin("memory.ssd.n_optimizer")),
            ("block_modes", modes or "(no blocks)", "plan"),
            ("update_mode", self.update_mode.value, "job"),
        ]
        predictions = [
            (
                "predicted step time",
                None if self.predicted_step_s is None else f"{self.predicted_step_s:.3f} s",
            ),
            ("predicted peak device", _opt_bytes(self.predicted_peak_device_bytes)),
            ("predicted peak host", _opt_bytes(self.predicted_peak_host_bytes)),
            ("of which outside the plan", _opt_bytes(self.host_fixed_bytes or None)),
            ("predicted SSD bytes", _opt_bytes(self.predicted_ssd_bytes)),
            ("NVMe optimizer state", _opt_bytes(self.predicted_nvme_bytes)),
            ("NVMe writes", self._nvme_write_words()),
        ]
        rows += [(name, value, "model") for name, value in predictions if value is not None]
        return rows


def _run_lengths(modes: tuple[BlockMode, ...]) -> list[tuple[str, int]]:
    runs: list[tuple[str, int]] = []
    for mode in modes:
        if runs and runs[-1][0] == mode.value:
            runs[-1] = (mode.value, runs[-1][1] + 1)
        else:
            runs.append((mode.value, 1))
    return runs


def format_bytes(num_bytes: int) -> str:
    """Bytes in binary units with two decimals ("1.50 GiB"), as the plan table and the planner's
    messages print them."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def _opt_bytes(num_bytes: int | None) -> str | None:
    return None if num_bytes is None else format_bytes(num_bytes)

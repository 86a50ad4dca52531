"""The memory picture ``protrain-run --plot`` writes (matplotlib, the ``plot`` extra).

Left, over the recorded update's time: device-tier, host and SSD bytes as sampled, the plan's
predicted peaks as dashed lines, the forward, backward and optimizer spans shaded, each block's
forward start (solid) and backward start (dotted) as thin lines labelled with the block, and
samples taken during a recomputation marked. Below it, sharing the time axis, one row per chunk:
its gathers (up) and evictions (down). Right: the step time split as stacked bars (measured,
the exposed waits, the plan's prediction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from protrain.launcher.step_bars import StepBars
from protrain.runtime.commands.plot import Timeline

SPAN_COLOURS = {"forward": "#dbe9f6", "backward": "#fbe3cf", "optimizer": "#dcefd8"}
LINE_COLOURS = {"device": "#1f5fa8", "host": "#c45a00", "ssd": "#6a3d9a"}
PART_COLOURS = {
    "forward": "#6baed6",
    "backward": "#fd8d3c",
    "optimizer": "#74c476",
    "other": "#bdbdbd",
}
WAIT_COLOURS = ("#de2d26", "#fc9272", "#9e9ac8", "#6a51a3", "#fdae6b")
MAX_BLOCK_LABELS = 24


def _unit(peak: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if peak >= scale:
            return float(scale), name
    return 1.0, "B"


def draw(timeline: Timeline, bars: StepBars, out: Path) -> None:
    # A Figure of its own, not pyplot's: no backend to choose, no global state, no display.
    figure = Figure(figsize=(14, 7.5), layout="constrained")
    grid = figure.add_gridspec(2, 2, width_ratios=(4, 1), height_ratios=(3, 1))
    memory = figure.add_subplot(grid[0, 0])
    chunks = figure.add_subplot(grid[1, 0], sharex=memory)
    steps = figure.add_subplot(grid[:, 1])
    figure.suptitle(
        f"ProTrain memory through update {timeline.update} (rank {timeline.rank}, {timeline.device}, "
        f"{timeline.micro_batches} micro-batch{'es' if timeline.micro_batches != 1 else ''})"
    )
    right = _memory_panel(memory, timeline)
    _chunk_panel(chunks, timeline)
    _step_panel(steps, bars)
    shading = [Patch(color=colour, label=phase) for phase, colour in SPAN_COLOURS.items()]
    handles: list[Any] = [*shading]
    names: list[str] = list(SPAN_COLOURS)  # the shading's labels, in its order
    for ax in (memory, right, chunks):
        more, more_names = ax.get_legend_handles_labels()
        handles += more
        names += more_names
    figure.legend(handles, names, loc="outside lower left", ncols=3, fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)


def _memory_panel(ax: Axes, timeline: Timeline) -> Axes:
    """Device bytes on the left axis, host and SSD bytes on the right one (their own scales:
    a host tier many times the device's would flatten the device curve); returns the right axis."""
    ms = [s.t * 1e3 for s in timeline.samples]
    for span in timeline.spans:
        if span.phase in SPAN_COLOURS:
            ax.axvspan(span.start * 1e3, span.end * 1e3, color=SPAN_COLOURS[span.phase], zorder=0)
    device = [s.device_bytes for s in timeline.samples]
    scale, unit = _unit(max([*device, timeline.predicted_peak_device_bytes or 0, 1]))
    ax.step(
        ms,
        [v / scale for v in device],
        where="post",
        color=LINE_COLOURS["device"],
        lw=1.6,
        label=f"device tier, left axis ({timeline.device_reading})",
    )
    if timeline.predicted_peak_device_bytes is not None:
        ax.axhline(
            timeline.predicted_peak_device_bytes / scale,
            color=LINE_COLOURS["device"],
            ls="--",
            lw=1.2,
            label="plan's predicted device peak",
        )
    recompute = [(s.t * 1e3, s.device_bytes / scale) for s in timeline.samples if s.phase == "recompute"]
    if recompute:
        ax.plot(*zip(*recompute, strict=True), "x", color="#444444", ms=5, label="sample during a recomputation")
    _block_marks(ax, timeline)
    ax.set_ylabel(f"device tier ({unit})", color=LINE_COLOURS["device"])
    ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-9) * 1.08)
    ax.grid(axis="y", alpha=0.3)
    ax.tick_params(labelbottom=False)

    right = ax.twinx()
    host = [s.host_bytes for s in timeline.samples]
    ssd = [s.ssd_bytes for s in timeline.samples]
    scale, unit = _unit(max([*host, *ssd, timeline.predicted_peak_host_bytes or 0, 1]))
    right.step(
        ms,
        [v / scale for v in host],
        where="post",
        color=LINE_COLOURS["host"],
        lw=1.6,
        label="host arenas, right axis (chunk state + swapped activations)",
    )
    if any(ssd):
        right.step(
            ms,
            [v / scale for v in ssd],
            where="post",
            color=LINE_COLOURS["ssd"],
            lw=1.6,
            label="activation files on SSD, right axis",
        )
    if timeline.predicted_peak_host_bytes is not None:
        right.axhline(
            timeline.predicted_peak_host_bytes / scale,
            color=LINE_COLOURS["host"],
            ls="--",
            lw=1.2,
            label="plan's predicted host peak",
        )
    right.set_ylabel(f"host / SSD ({unit})", color=LINE_COLOURS["host"])
    right.set_ylim(bottom=0, top=max(right.get_ylim()[1], 1e-9) * 1.08)
    return right


def _block_marks(ax: Axes, timeline: Timeline) -> None:
    marks = [m for m in timeline.marks if m.kind in ("block_forward", "block_backward")]
    blocks = {m.index for m in marks}
    every = max(1, -(-len(blocks) // MAX_BLOCK_LABELS))
    top = ax.get_xaxis_transform()
    for mark in marks:
        style = "-" if mark.kind == "block_forward" else ":"
        ax.axvline(mark.t * 1e3, color="#555555", ls=style, lw=0.6, alpha=0.6, zorder=1)
        if mark.index % every == 0:
            arrow = "F" if mark.kind == "block_forward" else "B"
            ax.text(mark.t * 1e3, 1.0, f"{arrow}{mark.index}", transform=top, fontsize=6, ha="center", va="bottom")


def _chunk_panel(ax: Axes, timeline: Timeline) -> None:
    for kind, marker, colour, label in (
        ("gather", "^", "#238b45", "chunk gathered (upload started)"),
        ("evict", "v", "#cb181d", "chunk evicted"),
    ):
        points = [(m.t * 1e3, m.index) for m in timeline.marks if m.kind == kind]
        if points:
            ax.plot(*zip(*points, strict=True), marker, color=colour, ms=5, ls="none", label=label)
    for span in timeline.spans:
        if span.phase in SPAN_COLOURS:
            ax.axvspan(span.start * 1e3, span.end * 1e3, color=SPAN_COLOURS[span.phase], zorder=0)
    if not any(m.kind in ("gather", "evict") for m in timeline.marks):
        ax.text(0.5, 0.5, "no chunk moved: every chunk is persistent", transform=ax.transAxes, ha="center")
    ax.set_ylabel("chunk")
    ax.set_xlabel(f"ms since update {timeline.update}'s first forward")
    locator = ax.yaxis.get_major_locator()
    if isinstance(locator, MaxNLocator):  # the default, AutoLocator
        locator.set_params(integer=True)
    ax.grid(axis="y", alpha=0.3)


def _step_panel(ax: Axes, bars: StepBars) -> None:
    columns: list[tuple[str, dict[str, float], dict[str, str]]] = [
        (bars.measured_label, bars.measured, PART_COLOURS),
    ]
    if bars.waits:
        colours = {kind: WAIT_COLOURS[i % len(WAIT_COLOURS)] for i, kind in enumerate(bars.waits)}
        columns.append(
            (
                "exposed\nwaits",
                {f"wait: {k}": v for k, v in bars.waits.items()},
                {f"wait: {k}": c for k, c in colours.items()},
            )
        )
    if bars.predicted_s is not None:
        columns.append(("predicted", {"predicted (the plan)": bars.predicted_s}, {"predicted (the plan)": "#969696"}))
    tallest = max(sum(parts.values()) for _, parts, _ in columns) or 1.0
    scale, unit = (1e3, "ms") if tallest < 10 else (1.0, "s")
    for x, (_, parts, colours) in enumerate(columns):
        bottom = 0.0
        for name, seconds in parts.items():
            ax.bar(
                x,
                seconds * scale,
                bottom=bottom,
                color=colours[name],
                width=0.6,
                label=name,
                edgecolor="white",
            )
            bottom += seconds * scale
        ax.text(
            x,
            bottom,
            f"{bottom:.0f}" if bottom >= 100 else f"{bottom:.3g}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(columns)), [label for label, _, _ in columns], fontsize=8)
    ax.set_ylabel(f"{unit} per update")
    ax.set_title("step time", fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncols=2)
    ax.grid(axis="y", alpha=0.3)

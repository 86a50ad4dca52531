"""``protrain-run --plot RUN_DIR``: the memory picture renders from a CPU run with a trace window
(every element drawn in its own colour), its step time bars read metrics.jsonl's split without
the instrumented updates, and bad input answers with exit 2 before torch or matplotlib load."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from protrain.launcher import cli, memory_picture
from protrain.launcher.step_bars import step_bars
from protrain.runtime.observability.timeline_file import Sample, Span, Timeline
from tests.unit.test_trace_window import traced_run

ROOT = Path(__file__).resolve().parents[2]


def colour_present(image: Any, hex_colour: str) -> bool:
    """Whether some pixel of the RGBA image has exactly this colour (lines and markers are
    drawn with it; antialiasing only blends their edges)."""
    import numpy as np

    rgb = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]) / 255
    return bool((np.abs(image[..., :3] - rgb).max(axis=-1) < 1.5 / 255).any())


def test_the_picture_renders_from_a_cpu_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image

    run_dir = traced_run(tmp_path)["run_dir"]
    assert cli.main(["--plot", str(run_dir)]) == 0
    png = run_dir / "memory-rank0.png"
    assert str(png) in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    height, width = image.shape[:2]
    assert width > height > 500
    for name, colour in {
        **{f"line {k}": v for k, v in memory_picture.LINE_COLOURS.items()},  # device, host, SSD
        **{f"span {k}": v for k, v in memory_picture.SPAN_COLOURS.items()},  # forward, backward, optimizer
        "gather": "#238b45",
        "evict": "#cb181d",
        **{f"bar {k}": v for k, v in memory_picture.PART_COLOURS.items() if k != "other"},
    }.items():
        assert colour_present(image, colour), f"{name} ({colour}) is not drawn"
    other = tmp_path / "elsewhere" / "picture.png"
    assert cli.main(["--plot", str(run_dir), "--out", str(other)]) == 0 and other.is_file()


def timeline(**changes: Any) -> Timeline:
    values: dict[str, Any] = dict(
        update=4,
        rank=0,
        device="cpu",
        device_reading="C heap",
        samples=(Sample(0.0, 10, 20, 0, "start"), Sample(0.5, 30, 20, 0, "end")),
        marks=(),
        spans=(
            Span("between", 0.0, 0.1),
            Span("forward", 0.1, 0.2),
            Span("backward", 0.2, 0.45),
            Span("optimizer", 0.45, 0.5),
        ),
        duration_s=0.5,
        micro_batches=2,
        predicted_step_s=0.125,
        predicted_peak_device_bytes=40,
        predicted_peak_host_bytes=None,
        device_budget_bytes=1 << 20,
        host_budget_bytes=1 << 20,
        instrumented_updates=(2, 3, 4),
    )
    return Timeline(**{**values, **changes})


def record(step: int, forward: float, **more: Any) -> dict[str, Any]:
    return {
        "step": step,
        "step_time_s": forward * 4,
        "time_metrics/forward(s)": forward,
        "time_metrics/backward(s)": 2 * forward,
        "time_metrics/optimizer(s)": forward / 2,
        "time_metrics/other(s)": forward / 2,
        "time_metrics/exposed_wait_transfer(s)": forward / 10,
        **more,
    }


def test_the_step_bars_are_medians_of_the_updates_nothing_slowed() -> None:
    records = [
        {"event": "plan"},
        record(1, 100.0),  # warm-up
        record(2, 50.0),  # traced
        record(3, 50.0),
        record(4, 50.0),  # its timeline
        record(5, 1.0),
        record(6, 3.0),
        record(7, 2.0),
        record(8, 900.0, skipped=True),
    ]
    bars = step_bars(timeline(), records)
    assert bars.measured == {"forward": 2.0, "backward": 4.0, "optimizer": 1.0, "other": 1.0}
    assert bars.waits == {"transfer": pytest.approx(0.2)}
    assert bars.predicted_s == 0.25  # per micro-batch, two in the update
    assert "median of 3" in bars.measured_label


def test_without_a_split_in_the_metrics_the_bars_come_from_the_timeline() -> None:
    old = [{"step": 5, "step_time_s": 0.4, "waits": {"transfer_s": 0.01, "host_s": 0.03}}]
    bars = step_bars(timeline(predicted_step_s=None), old)
    assert bars.measured == pytest.approx({"forward": 0.1, "backward": 0.25, "optimizer": 0.05, "other": 0.1})
    assert bars.waits == {"host": 0.03, "transfer": 0.01}
    assert bars.predicted_s is None
    assert "update 4" in bars.measured_label


def test_bad_input_exits_2_naming_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--plot", str(tmp_path / "missing")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    assert cli.main(["--plot", str(tmp_path)]) == 2
    assert "logging.trace" in capsys.readouterr().err
    (tmp_path / "memory-timeline-rank0.json").write_text("{}")
    assert cli.main(["--plot", str(tmp_path)]) == 2
    assert "not a memory timeline" in capsys.readouterr().err


def test_without_matplotlib_the_message_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    (tmp_path / "memory-timeline-rank0.json").write_text(json.dumps(timeline().to_json()))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    assert cli.main(["--plot", str(tmp_path)]) == 2
    assert "pip install 'protrain[plot]'" in capsys.readouterr().err


def test_the_bad_input_path_loads_neither_torch_nor_matplotlib(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from protrain.launcher.cli import main\n"
        f"assert main(['--plot', {str(tmp_path)!r}]) == 2\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)

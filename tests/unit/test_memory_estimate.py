"""The memory estimator (``protrain-run --what-if ... --model-config``): one row per placement of
model state and activations, with device, host and SSD bytes and the predicted step time, beside
the searched plan; and how protrain-run tells its script-free commands from a launch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from protrain.launcher.cli import FLAGS, build_parser, main, script_free_command
from protrain.launcher.remote_node import STOP_ON_STDIN_EOF
from protrain.launcher.report_cli import build_parser as build_report_parser
from protrain.launcher.what_if_cli import build_parser as build_what_if_parser
from protrain.profiler.activation_cost import CHECKPOINT, KEEP, SSD, SWAP, activation_cost
from protrain.profiler.analytic import KNOWN_CONFIGS, shape_from_config
from protrain.profiler.cost_model import chunk_costs, predict
from protrain.runtime.commands.memory_estimate import Budgets, estimate_rows, fits_text
from protrain.runtime.commands.what_if import machine_from_file, profile_model
from protrain.runtime.config.hardware_spec import load_hardware

ROOT = Path(__file__).resolve().parents[2]
HARDWARE = ROOT / "configs" / "hardware"
FP32_STATE_BYTES = 16
"""fp32 master, gradient and two Adam moments per parameter: what an offloaded parameter costs the host."""


def llama_7b_rows(hardware: str = "rtx3090-24gb", **batch: int):  # noqa: ANN201 - test helper
    machine = machine_from_file(load_hardware(HARDWARE / f"{hardware}.yaml"))
    shape = shape_from_config(KNOWN_CONFIGS["llama-2-7b"])
    profile = profile_model(
        shape,
        machine,
        micro_batch_size=batch.get("micro_batch_size", 1),
        seq_len=batch.get("seq_len", 1024),
        precision="bf16",
    )
    return machine, shape, profile, estimate_rows(profile, machine.hardware)


def test_one_row_per_placement_with_the_bytes_each_tier_holds() -> None:
    machine, shape, profile, rows = llama_7b_rows()
    by_key = {(row.offloaded, row.mode): row for row in rows}
    assert sorted(by_key) == sorted(
        (off, mode) for off in (False, True) for mode in (KEEP, SWAP, CHECKPOINT, SSD)
    )
    saved = sum(block.activation_bytes for block in profile.blocks)
    for offloaded in (False, True):
        keep, swap = by_key[offloaded, KEEP], by_key[offloaded, SWAP]
        recompute, ssd = by_key[offloaded, CHECKPOINT], by_key[offloaded, SSD]
        # Swapping every block moves exactly the blocks' saved bytes to the host; SSD to the disk.
        assert swap.host_bytes - keep.host_bytes == saved and swap.ssd_bytes == 0
        assert ssd.ssd_bytes == saved and ssd.host_bytes == keep.host_bytes
        # Every managed mode holds fewer activations on the device than keeping them all ...
        for managed in (swap, recompute, ssd):
            assert managed.activation_bytes < keep.activation_bytes
        # ... and recomputing pays a forward per block, unless CPU Adam hides it (offloaded).
        assert recompute.step_s >= keep.step_s
    assert by_key[False, CHECKPOINT].step_s > by_key[False, KEEP].step_s  # 2.08 s against 1.65 s
    resident, offloaded = by_key[False, KEEP], by_key[True, KEEP]
    assert resident.host_bytes == 0 and resident.n_buffer == 0 and resident.n_persist == resident.num_chunks
    # The host holds 16 bytes per parameter when everything is offloaded, plus chunk padding.
    assert (
        FP32_STATE_BYTES * shape.parameters
        <= offloaded.host_bytes
        < 1.15 * FP32_STATE_BYTES * shape.parameters
    )
    # Resident: the compute copy (2 bytes in bf16) beside those 16, on the device.
    assert 18 * shape.parameters <= resident.state_bytes < 1.15 * 18 * shape.parameters
    assert offloaded.n_persist == 0 and offloaded.n_buffer >= 2 and offloaded.state_bytes < 2 << 30


def test_each_row_is_the_cost_models_prediction_for_its_knobs() -> None:
    """The knobs a row reports are the ones its figures came from: the cost model, asked again
    for those knobs, predicts the same bytes and time."""
    machine, _, profile, rows = llama_7b_rows()
    for row in rows:
        modes = [row.mode] * len(profile.blocks)
        cost = None if row.mode == KEEP else activation_cost(profile, machine.hardware, modes)
        again = predict(
            profile,
            machine.hardware,
            chunk_costs(profile, machine.hardware, row.chunk_size),
            n_persist=row.n_persist,
            n_buffer=row.n_buffer,
            activations=cost,
        )
        assert (again.peak_device_bytes, again.host_bytes, again.ssd_bytes) == (
            row.device_bytes,
            row.host_bytes,
            row.ssd_bytes,
        )
        assert again.step_s == pytest.approx(row.step_s)


def test_no_ssd_rows_without_a_disk_in_the_hardware_file(tmp_path: Path) -> None:
    no_disk = tmp_path / "no-disk.yaml"
    text = (HARDWARE / "a100-80gb.yaml").read_text()
    no_disk.write_text(text[: text.index("ssd:")])
    machine = machine_from_file(load_hardware(no_disk))
    profile = profile_model(
        shape_from_config(KNOWN_CONFIGS["gpt2"]), machine, micro_batch_size=1, seq_len=512, precision="bf16"
    )
    assert {row.mode for row in estimate_rows(profile, machine.hardware)} == {KEEP, SWAP, CHECKPOINT}


def test_fits_counts_the_search_margin_on_the_device_only() -> None:
    budgets = Budgets(device=100, host=50)
    assert fits_text(95, 50, budgets) == "yes"  # 95 x 1.05 = 99.75
    assert fits_text(96, 50, budgets) == "no: device"  # 100.8
    assert fits_text(10, 51, budgets) == "no: host"
    assert fits_text(200, 51, budgets) == "no: both"


def table_rows(out: str) -> list[list[str]]:
    """The estimate table's body rows (after the rule under the header, up to the first line the
    table did not indent), split on the column gaps."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() and set(line.strip()) == {"─"})
    rows = []
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break
        if line.strip():
            rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_the_command_prints_the_table_the_summary_and_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--what-if", str(HARDWARE / "rtx3090-24gb.yaml"), "--model-config", "llama-2-7b"]) == 0
    out = capsys.readouterr().out
    assert "Memory estimate: llama-2-7b (6.74B parameters)" in out
    rows = table_rows(out)
    assert [row[:2] for row in rows[:8]] == [
        [state, activations]
        for state in ("device", "host (2 buffers)")
        for activations in ("kept", "to host", "recomputed", "to SSD")
    ]
    # A 24 GB card holds none of the resident placements and all of the offloaded ones.
    assert [row[-1] for row in rows[:8]] == ["no: device"] * 4 + ["yes"] * 4
    search = rows[8]  # its words wrap onto a ninth line in an 80-column console
    assert search[0].startswith("search: 7/45") and search[-1] == "yes"
    # The search's row repeats the plan table's predictions (to the table's 0.1 GiB).
    device = re.search(r"predicted peak device\s*│\s*([\d.]+) GiB", out)
    host = re.search(r"predicted peak host\s*│\s*([\d.]+) GiB", out)
    assert device and host, out
    assert search[2:4] == [f"{float(device.group(1)):.1f}", f"{float(host.group(1)):.1f}"]
    summary = " ".join(out.split("Model state:", 1)[1].split())
    assert "on the device when resident" in summary and "on the host when offloaded" in summary


def test_nothing_fits_still_prints_the_estimate_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--what-if", str(HARDWARE / "rtx3090-24gb.yaml"), "--model-config", "llama-2-70b"]) == 1
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert len(rows) == 8 and all(row[-1].startswith("no:") for row in rows)
    assert "does not fit" in out and "host budget" in " ".join(out.split())


def gpt_2_7b_config(tmp_path: Path) -> Path:
    """GPT-3's 2.7B shape, whose search on the RTX 3090 puts some blocks on disk when allowed."""
    folder = tmp_path / "gpt-2.7b"
    folder.mkdir()
    config = {"model_type": "gpt2", "n_embd": 2560, "n_layer": 32, "n_head": 32, "vocab_size": 50257}
    (folder / "config.json").write_text(json.dumps({**config, "n_positions": 2048}))
    return folder


def test_ssd_joins_the_search_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = gpt_2_7b_config(tmp_path)
    hardware = str(HARDWARE / "rtx3090-24gb.yaml")

    def offloaded_blocks(*extra: str) -> int:
        # A directory holding config.json is taken too, named after the directory.
        assert main(["--what-if", hardware, "--model-config", str(folder), *extra]) == 0
        out = capsys.readouterr().out
        assert "Memory estimate: gpt-2.7b" in out
        found = re.search(r"ssd\.n_offload\s*│\s*(\d+)", out)
        assert found, out
        return int(found.group(1))

    assert offloaded_blocks() == 0
    assert offloaded_blocks("--ssd") > 0


def test_bad_estimator_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    no_disk = tmp_path / "no-disk.yaml"
    text = (HARDWARE / "a100-80gb.yaml").read_text()
    no_disk.write_text(text[: text.index("ssd:")])
    assert main(["--what-if", str(no_disk), "--model-config", "gpt2", "--ssd"]) == 2
    assert "--ssd needs the hardware file's ssd section" in capsys.readouterr().err
    # GPT-2 learned 1024 positions: a longer sequence is bad input, not a traceback.
    assert (
        main(["--what-if", str(HARDWARE / "a100-80gb.yaml"), "--model-config", "gpt2", "--seq-len", "2048"])
        == 2
    )
    assert "--seq-len: seq_len 2048 exceeds the model's 1024 positions" in capsys.readouterr().err
    assert (
        main(["--what-if", str(HARDWARE / "a100-80gb.yaml"), "--model-config", str(tmp_path / "x.json")]) == 2
    )
    assert capsys.readouterr().err.count("no such file") == 1


def test_help_names_the_estimator_and_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--what-if HARDWARE.yaml the memory estimator" in out and "--report the environment report" in out
    assert main(["--what-if", "--help"]) == 0
    assert "The memory estimator" in capsys.readouterr().out
    assert main(["--report", "-h"]) == 0
    assert "--ssd-path DIR" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["--what-if", "hw.yaml", "--largest"], "--what-if"),
        (["--model-config", "c.json", "--what-if", "hw.yaml"], "--what-if"),  # a value is skipped
        (["--largest", "--what-if=hw.yaml"], "--what-if"),
        (["--config", "job.yaml", "--set", "a.b=1", "--report"], "--report"),
        (["--json", "--report"], "--report"),
        (["train.py", "--report"], None),  # the script's own option
        (["--dry-run", "train.py", "--what-if", "x"], None),
        (["--nproc-per-node", "2", "train.py", "--", "--report"], None),
        (["--config", "--report"], None),  # --report is --config's value: the launch reports the error
    ],
)
def test_a_command_is_picked_only_before_the_script(argv: list[str], command: str | None) -> None:
    assert script_free_command(argv) == command


def test_the_flag_list_holds_every_option_without_a_value() -> None:
    """script_free_command skips the value after every option not in FLAGS: a new flag left out
    would swallow the next argument."""
    flags = {
        option
        for parser in (build_parser(), build_what_if_parser(), build_report_parser())
        for action in parser._actions
        if action.nargs == 0
        for option in action.option_strings
    }
    # The hidden option a remote node's command starts with is read before the parsers run.
    assert flags | {STOP_ON_STDIN_EOF} == FLAGS


def test_a_script_option_named_report_goes_to_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-train.py", "--report"]) == 2
    assert "no-such-train.py: no such training script" in capsys.readouterr().err

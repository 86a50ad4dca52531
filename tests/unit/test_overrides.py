"""``--set`` parsing and precedence: command line > spec launcher section > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from protrain.launcher.cli import parse_command_line, resolve_spec
from protrain.runtime.config.spec import Precision
from protrain.runtime.config.spec_io import SpecError, load_spec, parse_override


def test_set_values_are_typed_like_the_file() -> None:
    assert parse_override("memory.n_swap=2").value == 2
    assert parse_override("optimizer.lr=3e-4").value == pytest.approx(3e-4)
    assert parse_override("optimizer.betas=[0.9, 0.99]").value == [0.9, 0.99]
    assert parse_override("memory.ssd.path=null").value is None
    assert parse_override("memory.device_budget=22GiB").value == "22GiB"
    assert parse_override("memory.n_swap=auto").value == "auto"


def test_yaml_reads_exponent_floats(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("optimizer: {lr: 3e-4, eps: 1e-8}\n")
    spec = load_spec(config)
    assert spec.optimizer.lr == pytest.approx(3e-4)
    assert spec.optimizer.eps == pytest.approx(1e-8)


def test_later_set_wins_and_file_is_overridden(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("precision: bf16\nmemory: {n_swap: 1}\n")
    overrides = [
        parse_override("memory.n_swap=2"),
        parse_override("memory.n_swap=3"),
        parse_override("precision=fp32"),
    ]
    spec = load_spec(config, overrides)
    assert spec.memory.n_swap == 3
    assert spec.precision is Precision.FP32


def test_set_creates_missing_sections() -> None:
    spec = load_spec(
        None, [parse_override("memory.ssd.path=/nvme"), parse_override("memory.ssd.n_offload=2")]
    )
    assert spec.memory.ssd.path == "/nvme"
    assert spec.memory.ssd.n_offload == 2


def test_launcher_precedence(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("launcher: {nproc_per_node: 4, nnodes: 2, master_port: 1234}\n")
    script = tmp_path / "train.py"
    script.write_text("")
    request = parse_command_line(
        ["--nproc-per-node", "2", str(script), "--config", str(config), "--set", "launcher.nproc_per_node=3"]
    )
    spec = resolve_spec(request)
    assert spec.launcher.nproc_per_node == 2  # the launcher option beats the file and --set
    assert spec.launcher.nnodes == 2  # spec file
    assert spec.launcher.master_port == 1234  # spec file
    assert spec.launcher.master_addr == "127.0.0.1"  # default


def test_config_and_set_anywhere_before_double_dash(tmp_path: Path) -> None:
    request = parse_command_line(
        [
            "--dry-run",
            "train.py",
            "--steps",
            "3",
            "--config",
            "job.yaml",
            "--set=seed=5",
            "--lr",
            "1",
            "--",
            "--config",
            "script.yaml",
        ]
    )
    assert request.config == Path("job.yaml")
    assert request.script_args == ("--steps", "3", "--lr", "1", "--config", "script.yaml")
    assert [o.key_path for o in request.overrides] == [("seed",)]
    assert request.dry_run


def test_config_twice_is_an_error() -> None:
    with pytest.raises(SpecError, match="--config given twice"):
        parse_command_line(["train.py", "--config", "a.yaml", "--config", "b.yaml"])


def test_set_error_names_the_override() -> None:
    with pytest.raises(SpecError, match=r"--set memory.n_buffer=x: memory.n_buffer: got 'x'"):
        load_spec(None, [parse_override("memory.n_buffer=x")])


def test_torchruns_spellings_standalone_and_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What torchrun and deepspeed users type: the underscore spellings of the launcher options,
    ``--standalone`` (one node, a free local port) and ``--version``."""
    from protrain.launcher.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    underscores = parse_command_line(
        ["--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0", "--master_addr", "10.0.0.7",
         "--master_port", "29511", "--max_restarts", "1", str(script)]
    )
    dashes = parse_command_line(
        ["--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0", "--master-addr", "10.0.0.7",
         "--master-port", "29511", "--max-restarts", "1", str(script)]
    )
    assert resolve_spec(underscores).launcher == resolve_spec(dashes).launcher
    launcher = resolve_spec(underscores).launcher
    assert (launcher.nproc_per_node, launcher.master_addr, launcher.master_port) == (2, "10.0.0.7", 29511)

    config = tmp_path / "job.yaml"
    config.write_text("launcher: {nnodes: 2, master_addr: 10.0.0.9, master_port: 1234}\n")
    command = ["--standalone", "--nproc_per_node", "2", str(script), "--config", str(config)]
    standalone = resolve_spec(parse_command_line(command))
    assert (standalone.launcher.nnodes, standalone.launcher.master_addr, standalone.launcher.master_port) == (
        1,
        "127.0.0.1",
        0,
    )
    with pytest.raises(SpecError, match="--standalone runs one node, not --nnodes 2"):
        parse_command_line(["--standalone", "--nnodes", "2", str(script)])

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("protrain-run 0.1.0 (torch ") and "Python 3." in out

"""Every shipped spec validates and starts with a comment giving its exact command."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from protrain.launcher.cli import parse_command_line
from protrain.runtime.config.spec_io import load_spec

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    names = {path.name for path in CONFIGS}
    assert {"demo-cpu.yaml", "cpu-smoke.yaml", "llama-7b-24gb.yaml", "llama-70b-80gb.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_validates_and_documents_its_command(path: Path) -> None:
    load_spec(path)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#"), "first line must be a comment saying what the job is"
    commands = [line.lstrip("# ").strip() for line in lines if line.lstrip("# ").startswith("protrain-run ")]
    assert commands, "no protrain-run command in the header comment"
    request = parse_command_line(shlex.split(commands[0])[1:])
    assert request.config is not None and (ROOT / request.config).resolve() == path
    assert (ROOT / request.script).is_file()

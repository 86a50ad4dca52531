"""Every shipped spec does what its header says: its ``protrain-run`` command trains (at a tiny
preset of the same architecture, through the meta-device, chunk-by-chunk path the large presets
take, with chunks offloaded on a small device budget; one rank, in-process: tests/e2e launches
the multi-rank headers), train_lm.py builds the large presets on the meta device, and the
full-size job fits its own budgets in the what-if planner on the hardware the header names."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import runpy
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from protrain.launcher.cli import main as protrain_run
from protrain.launcher.cli import parse_command_line, resolve_spec
from protrain.launcher.what_if_cli import parse_what_if
from protrain.profiler.analytic import KNOWN_CONFIGS, shape_from_config
from protrain.runtime.commands.what_if import machine_for, plan_for
from protrain.runtime.commands.what_if_machine import HOST_RESERVE_BYTES
from protrain.runtime.config.hardware_spec import load_hardware
from protrain.runtime.config.spec import AUTO
from protrain.runtime.config.spec_io import RESOLVED_SPEC_ENV, ResolvedSpec, load_spec, write_resolved
from tests.config_commands import assert_trained_through_chunks, header_commands, tiny_command
from tests.helpers import assert_state_equal

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
GPU_CONFIGS = [path for path in CONFIGS if "--what-if" in path.read_text()]


def run_in_process(argv: list[str], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What protrain-run does for one rank, in this process: resolve the spec from the command
    line (validated as the launcher validates it), write it where the rank reads it, run the
    script as ``__main__`` with its arguments (as protrain_launcher.rank_entry runs it)."""
    request = parse_command_line(argv)
    spec = resolve_spec(request)
    run_dir.mkdir(parents=True)
    spec_path = run_dir / "spec.json"
    write_resolved(ResolvedSpec.of(spec, source=str(request.config)), spec_path)
    monkeypatch.setenv(RESOLVED_SPEC_ENV, str(spec_path))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(request.script), *request.script_args])
    runpy.run_path(str(request.script), run_name="__main__")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_header_command_trains_at_a_tiny_preset_through_streamed_chunks(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_in_process(tiny_command(path, tmp_path), tmp_path / "run", monkeypatch)
    assert_trained_through_chunks(capsys.readouterr().out, tmp_path / "run" / "metrics.jsonl")


def host_ram_claim_bytes(path: Path) -> int:
    """The host RAM the header's first line promises ("~256 GB of host RAM", "1.5 TB ...")."""
    match = re.search(r"([\d.]+) (TB|GB) (?:or more )?of host RAM", path.read_text().splitlines()[0])
    assert match, f"{path.name}: the first line must say how much host RAM the job needs"
    return int(float(match.group(1)) * {"TB": 10**12, "GB": 10**9}[match.group(2)])


def what_if_argv(path: Path) -> list[str]:
    (argv,) = [command for command in header_commands(path) if "--what-if" in command]
    return argv


def test_configs_for_gpus_name_their_planner_command() -> None:
    gpu = {path.name for path in CONFIGS if re.search(r"\d+ GB GPU", path.read_text().splitlines()[0])}
    assert gpu and gpu <= {path.name for path in GPU_CONFIGS}


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=[p.name for p in GPU_CONFIGS])
def test_full_size_plan_fits_the_configs_own_budgets(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = what_if_argv(path)
    assert protrain_run(argv) == 0, capsys.readouterr().err  # the header's planner command, as written
    options = dict(zip(argv[::2], argv[1::2], strict=True))
    assert ROOT / options["--config"] == path, "the header's planner command must read this file"
    train = header_commands(path)[0]
    assert options["--seq-len"] == train[train.index("--seq-len") + 1]
    request = parse_what_if(argv)
    spec = load_spec(path)
    assert request.job is not None and request.job.async_save == spec.checkpoint.async_save
    assert (request.micro_batch_size, request.precision) == (spec.micro_batch_size, spec.precision)
    assert request.clipping == bool(spec.gradient_clipping)
    hardware = load_hardware(ROOT / options["--what-if"])
    machine = machine_for(request, hardware)
    host_ram = host_ram_claim_bytes(path)
    if spec.memory.host_budget == AUTO:  # the header's RAM, not the hardware file's, is the claim
        machine = dataclasses.replace(machine, host_budget=host_ram - HOST_RESERVE_BYTES)
    assert machine.device_budget <= hardware.gpu.memory, "the device budget exceeds the GPU the header names"
    assert machine.host_budget <= host_ram, "the host budget exceeds the host RAM the header names"
    # The plan with what the job adds beside it (an async save's staging copy) fits the budgets.
    plan = plan_for(shape_from_config(KNOWN_CONFIGS[options["--model-config"]]), machine, request)
    assert plan.predicted_peak_device_bytes is not None and plan.predicted_peak_host_bytes is not None
    assert plan.predicted_peak_device_bytes <= machine.device_budget
    assert plan.predicted_peak_host_bytes <= machine.host_budget


def load_train_lm(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "scripts" / "train_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_lm", module)  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_presets_too_large_for_the_device_are_built_on_the_meta_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--init auto, as the script's docstring says: the Llama 7B and 70B presets stream into
    chunks (with the 7B spec's 22 GiB budget, and with an auto budget), every GPT preset and
    the tiny Llama are built whole."""
    from accelerate import init_empty_weights

    train_lm = load_train_lm(monkeypatch)
    budget = load_spec(ROOT / "configs" / "llama-7b-24gb.yaml").memory.device_budget
    streamed = set()
    for arch, presets in (("gpt", train_lm.PRESETS), ("llama", train_lm.LLAMA_PRESETS)):
        for preset in presets:
            factory, _, _ = train_lm.model_factory(arch, preset)
            with init_empty_weights():
                parameter_bytes = sum(p.numel() * 4 for p in factory().parameters())
            on_meta = {
                train_lm.builds_on_meta(parameter_bytes, device_budget=limit, init="auto")
                for limit in (budget, AUTO)
            }
            assert len(on_meta) == 1, f"{arch} {preset}: the two budgets disagree"
            if on_meta.pop():
                streamed.add(f"{arch}-{preset}")
    assert streamed == {"llama-7b", "llama-70b"}
    assert train_lm.builds_on_meta(1, device_budget=AUTO, init="chunks")
    assert not train_lm.builds_on_meta(1 << 40, device_budget=AUTO, init="whole")


@pytest.mark.timeout(120)
def test_weights_dir_of_safetensors_shards_is_streamed_into_the_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--weights DIR: the parameters come from the shards (an lr of 1e-30 is below every fp32
    weight's rounding, so one update leaves them as read, and --export writes them out)."""
    from accelerate import init_empty_weights

    train_lm = load_train_lm(monkeypatch)
    factory, _, _ = train_lm.model_factory("llama", "tiny")
    torch.manual_seed(5)
    source = factory()
    source.save_pretrained(tmp_path / "pretrained", max_shard_size="100KB")
    assert len(list((tmp_path / "pretrained").glob("*.safetensors"))) > 1
    argv = tiny_command(ROOT / "configs" / "llama-7b-24gb.yaml", tmp_path, "optimizer.lr=1.0e-30")
    argv[argv.index("--steps") + 1] = "1"
    argv += ["--weights", str(tmp_path / "pretrained"), "--export", str(tmp_path / "export")]
    run_in_process(argv, tmp_path / "run", monkeypatch)
    # The console wraps long lines anywhere (inside the path too): compare without whitespace.
    out = "".join(capsys.readouterr().out.split())
    assert "".join(f"filled chunk by chunk ({tmp_path / 'pretrained'})".split()) in out
    with init_empty_weights():
        exported = factory()
    from safetensors.torch import load_file

    state = {}
    for shard in (tmp_path / "export").glob("*.safetensors"):
        state.update(load_file(str(shard)))
    expected = source.state_dict()
    assert set(state) == {name for name, _ in exported.named_parameters()}
    assert_state_equal(state, {name: expected[name] for name in state})

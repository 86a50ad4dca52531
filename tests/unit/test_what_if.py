"""What-if planning for hardware that is not here: analytic profiles from model configs, the
shipped hardware files, and `protrain-run --what-if` as a user runs it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from protrain.launcher.cli import main
from protrain.launcher.what_if_cli import parse_what_if
from protrain.profiler.analytic import KNOWN_CONFIGS, analytic_profile, shape_from_config
from protrain.runtime.commands.what_if import _largest_that_fits, machine_for, plan_for
from protrain.runtime.config.hardware_spec import load_hardware

ROOT = Path(__file__).resolve().parents[2]
HARDWARE = ROOT / "configs" / "hardware"

LLAMA_2_7B = KNOWN_CONFIGS["llama-2-7b"]


def test_parameter_counts_match_the_real_models() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    assert shape_from_config(LLAMA_2_7B).parameters == 6_738_415_616  # Llama-2-7B, as published
    assert shape_from_config(KNOWN_CONFIGS["gpt2"]).parameters == 124_439_808  # GPT-2 small
    small_llama = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        built = [LlamaForCausalLM(small_llama), GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4))]
    configs = [small_llama.to_dict(), GPT2Config(n_embd=64, n_layer=2, n_head=4).to_dict()]
    for model, config in zip(built, configs, strict=True):
        assert shape_from_config(config).parameters == sum(p.numel() for p in model.parameters())


def test_analytic_profile_scales_with_the_batch() -> None:
    shape = shape_from_config(LLAMA_2_7B)
    one = analytic_profile(shape, micro_batch_size=1, seq_len=1024, precision="bf16", sustained_flops=1e14)
    two = analytic_profile(shape, micro_batch_size=2, seq_len=1024, precision="bf16", sustained_flops=1e14)
    assert len(one.blocks) == 32 and one.blocks[0].backward_s == pytest.approx(2 * one.blocks[0].forward_s)
    assert two.activation_bytes == 2 * one.activation_bytes
    assert two.forward_s == pytest.approx(2 * one.forward_s)
    # 6 x parameters x tokens FLOPs per step, within the attention term: ~0.45 s at 100 TFLOP/s.
    assert one.forward_s + one.backward_s == pytest.approx(6 * shape.parameters * 1024 / 1e14, rel=0.1)


def test_the_shipped_hardware_files_load() -> None:
    names = sorted(path.stem for path in HARDWARE.glob("*.yaml"))
    assert names == ["a100-80gb", "h100-80gb", "rtx3090-24gb", "rtx4090-64gb-nvme"]
    for path in HARDWARE.glob("*.yaml"):
        spec = load_hardware(path)
        assert spec.gpu.memory > 20 << 30 and spec.host.memory >= 64 * 10**9
        assert spec.ssd is not None and spec.ssd.capacity is not None and spec.ssd.capacity >= 2 * 10**12


HOST_BYTES_PER_PARAMETER = {"off": 12, "on": 16}
"""What the host tier holds per offloaded parameter: fp32 master and two Adam moments, and with
clipping on an fp32 gradient kept until the norm is known."""
EXPECTED_LARGEST = {
    ("a100-80gb", "off"): "gpt-75b",
    ("a100-80gb", "on"): "gpt-65b",
    ("rtx3090-24gb", "off"): "gpt-30b",
    ("rtx3090-24gb", "on"): "gpt-20b",
}
"""The paper's 75B on the A100-80GB with 1 TB and (about) its 34B on the RTX 3090 with 384 GB, with
clipping off; with it on, a size less."""


def largest_line(out: str, prefix: str) -> tuple[str, float, str]:
    """(model, parameters, update words) of a "largest that fits" line of ``--largest``."""
    match = re.search(prefix + r" (\S+) \(([\d.]+)B parameters\), (clipping \w+ \([^)]*\))", out)
    assert match, out
    return match.group(1), float(match.group(2)) * 1e9, match.group(3)


@pytest.mark.parametrize("flags", [[], ["--clipping"]], ids=["default", "clipping"])
def test_largest_model_per_machine_and_what_binds(capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    asked = "on" if flags else "off"
    other = "off" if flags else "on"
    for machine in ("a100-80gb", "rtx3090-24gb"):
        assert main(["--what-if", str(HARDWARE / f"{machine}.yaml"), "--largest", *flags]) == 0
        out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
        # The title says which case the table is, and where it came from: the spec's default
        # (off, as a job spec without gradient_clipping runs) unless a flag asked.
        source = "--clipping" if flags else "the spec's default"
        assert f"clipping {asked} ({source})" in out.split("largest that fits")[0]
        assert f"{HOST_BYTES_PER_PARAMETER[asked]} host bytes per offloaded parameter" in out
        name, params_fit, words = largest_line(out, "largest that fits:")
        assert name == EXPECTED_LARGEST[machine, asked] and words.startswith(f"clipping {asked}")
        # Both answers: the Trainer clips by default, a spec does not.
        other_name, other_params, other_words = largest_line(out, f"with clipping {other} instead:")
        assert other_name == EXPECTED_LARGEST[machine, other] and other_words.startswith(f"clipping {other}")
        fails = re.search(r"first that does not: \S+ \(([\d.]+)B\): no plan fits the host budget of ([\d.]+) GiB", out)
        assert fails, out
        params_fail = float(fails.group(1)) * 1e9
        host_budget = float(fails.group(2)) * 2**30
        # What this guards: host memory binds first, at 12 or 16 bytes per parameter, to the
        # resolution of the size grid. The largest fitting model's state fits the host budget, the
        # next size's would not: a planner that under-counts the host state (e.g. forgets the Adam
        # moments) picks a larger model, one that over-counts it (chunk padding, a gradient it
        # does not keep) a smaller one, and either breaks one side.
        per_parameter = HOST_BYTES_PER_PARAMETER[asked]
        assert params_fit * per_parameter <= host_budget < params_fail * per_parameter
        assert other_params * HOST_BYTES_PER_PARAMETER[other] <= host_budget


def test_a_model_config_gets_a_plan_with_predictions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "llama-7b.json"
    config.write_text(json.dumps(LLAMA_2_7B))
    assert main(["--what-if", str(HARDWARE / "rtx3090-24gb.yaml"), "--model-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "llama-7b (6.74B parameters)" in out
    assert "predicted step time" in out and "predicted peak device" in out and "search: fastest of" in out


def test_bad_what_if_input_exits_2_naming_the_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((HARDWARE / "a100-80gb.yaml").read_text().replace("tflops: 312", "tflops: fast"))
    assert main(["--what-if", str(bad), "--largest"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: gpu.tflops: got 'fast'" in err and "allowed: a number > 0" in err
    assert main(["--what-if", str(tmp_path / "none.yaml"), "--largest"]) == 2
    assert "none.yaml: no such file" in capsys.readouterr().err
    config = tmp_path / "model.json"
    config.write_text(json.dumps({"hidden_size": 64}))
    assert main(["--what-if", str(HARDWARE / "a100-80gb.yaml"), "--model-config", str(config)]) == 2
    assert "model.json: the model config has none of num_attention_heads, n_head" in capsys.readouterr().err


def write_job(folder: Path, text: str) -> Path:
    job = folder / "job.yaml"
    job.write_text(text)
    return job


def test_a_job_spec_sets_batch_precision_clipping_accumulation_and_budgets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a short path: the console would break a long one across lines
    job = Path("job.yaml")
    write_job(
        tmp_path,
        "micro_batch_size: 4\ngradient_accumulation_steps: 8\nprecision: fp32\ngradient_clipping: 1.0\n"
        "memory: {device_budget: 20GiB, host_budget: 300GiB}\n",
    )
    hardware = str(HARDWARE / "rtx3090-24gb.yaml")
    assert main(["--what-if", hardware, "--model-config", "llama-2-7b", "--config", str(job)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "batch 4 x 1024, fp32, clipping on (" + str(job) + "), 8 micro-batches a window" in out
    assert "budgets 20.0 GiB device, 300.0 GiB host" in out
    # A flag given on the command line wins over the file.
    argv = ["--what-if", hardware, "--model-config", "llama-2-7b", "--config", str(job)]
    assert main([*argv, "--no-clipping", "--micro-batch-size", "2", "--precision", "bf16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "batch 2 x 1024, bf16, clipping off (--no-clipping), 8 micro-batches a window" in out


def test_an_async_save_in_the_job_spec_counts_its_staging_copy(tmp_path: Path) -> None:
    """checkpoint.async_save copies every parameter's fp32 master and two moments to the host
    first: 12 bytes per parameter beside the plan's own host state."""
    hardware = load_hardware(HARDWARE / "a100-80gb.yaml")
    shape = shape_from_config(LLAMA_2_7B)
    plans = {}
    for async_save in (False, True):
        job = write_job(tmp_path, f"checkpoint: {{dir: ckpt, async_save: {str(async_save).lower()}}}\n")
        request = parse_what_if(["--what-if", str(HARDWARE / "a100-80gb.yaml"), "--largest", "--config", str(job)])
        plans[async_save] = plan_for(shape, machine_for(request, hardware), request)
    assert plans[True].host_fixed_bytes == 12 * shape.parameters
    assert plans[True].predicted_peak_host_bytes == plans[False].predicted_peak_host_bytes + 12 * shape.parameters


def test_a_frozen_base_needs_one_compute_copy_on_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    """--frozen '*' plans a LoRA-style base: offloaded, each frozen parameter is its bf16 copy
    (2 bytes), not a master, two moments and a gradient (16 with clipping)."""
    hardware = str(HARDWARE / "rtx3090-24gb.yaml")
    host_row = re.compile(r"host \(\d+ buffers\)\s+kept\s+[\d,.]+\s+([\d,.]+)")
    needs = {}
    for frozen in ([], ["--frozen", "*"]):
        assert main(["--what-if", hardware, "--model-config", "llama-2-7b", "--clipping", *frozen]) == 0
        out = capsys.readouterr().out
        match = host_row.search(out)
        assert match, out
        needs[bool(frozen)] = float(match.group(1).replace(",", "")) * 2**30
    parameters = shape_from_config(LLAMA_2_7B).parameters
    assert needs[False] == pytest.approx(16 * parameters, rel=0.05)
    assert needs[True] == pytest.approx(2 * parameters, rel=0.05)
    assert "6.74B frozen" in " ".join(out.split())


def test_bad_job_specs_and_patterns_exit_2_naming_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hardware = str(HARDWARE / "rtx3090-24gb.yaml")
    job = write_job(tmp_path, "micro_batch_size: many\n")
    assert main(["--what-if", hardware, "--largest", "--config", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"{job}" in err and "micro_batch_size" in err
    job = write_job(tmp_path, "memory: {device_budget: 40GiB}\n")
    assert main(["--what-if", hardware, "--largest", "--config", str(job)]) == 2
    assert f"{job}: memory.device_budget: 40.0 GiB is more than the 24.0 GiB GPU" in capsys.readouterr().err
    assert main(["--what-if", hardware, "--model-config", "llama-2-7b", "--frozen", "encoder.*"]) == 2
    assert "--frozen encoder.*: matches no parameter of llama-2-7b" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "host_bytes"),
    [
        ([], 16),
        (["--optimizer", "lion"], 12),
        (["--optimizer", "sgd", "--momentum", "0.9"], 12),
        (["--optimizer", "sgd"], 8),
    ],
    ids=["adamw", "lion", "sgd-momentum", "sgd"],
)
def test_the_optimizer_sets_the_host_bytes_per_parameter(
    capsys: pytest.CaptureFixture[str], flags: list[str], host_bytes: int
) -> None:
    """With clipping (gradients kept): the fp32 master, the gradient and the rule's state. The
    title says the bytes; the offloaded row needs them."""
    hardware = str(HARDWARE / "rtx3090-24gb.yaml")
    assert main(["--what-if", hardware, "--model-config", "llama-2-7b", "--clipping", *flags]) == 0
    out = capsys.readouterr().out
    assert f"{host_bytes} host bytes per offloaded parameter" in " ".join(out.split())
    match = re.search(r"host \(\d+ buffers\)\s+kept\s+[\d,.]+\s+([\d,.]+)", out)
    assert match, out
    need = float(match.group(1).replace(",", "")) * 2**30
    assert need == pytest.approx(host_bytes * shape_from_config(LLAMA_2_7B).parameters, rel=0.05)


def test_a_leaner_optimizer_fits_a_larger_model_and_momentum_needs_sgd(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Host memory binds the largest model on the RTX 3090 machine: with SGD's 8 bytes per
    parameter instead of AdamW's 16 (clipping on) it holds a model at least 1.5x larger."""
    hardware = str(HARDWARE / "rtx3090-24gb.yaml")
    largest = {}
    for optimizer in ("adamw", "sgd"):
        request = parse_what_if(["--what-if", hardware, "--largest", "--clipping", "--optimizer", optimizer])
        found = _largest_that_fits(machine_for(request, load_hardware(hardware)), request)
        assert found is not None
        largest[optimizer] = found[1]
    assert largest["sgd"] >= 1.5 * largest["adamw"], largest
    assert main(["--what-if", hardware, "--largest", "--optimizer", "lion", "--momentum", "0.9"]) == 2
    assert "--momentum applies to --optimizer sgd only" in capsys.readouterr().err
    job = write_job(tmp_path, "optimizer: {type: sgd, momentum: 0.9}\n")
    request = parse_what_if(["--what-if", hardware, "--largest", "--config", str(job)])
    assert (request.optimizer, request.momentum, request.optimizer_states) == ("sgd", 0.9, 1)


def test_an_unknown_optimizer_exits_2_naming_the_rules(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--what-if", str(HARDWARE / "a100-80gb.yaml"), "--largest", "--optimizer", "lamb"]) == 2
    assert "--optimizer lamb: not one of adamw, adam, lion, sgd" in capsys.readouterr().err

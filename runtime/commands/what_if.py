"""What-if planning, the memory estimator: plan and predict for hardware that is not here, from a
hardware file and a model configuration alone (an analytic profile: no weights, no torch).

    protrain-run --what-if configs/hardware/a100-80gb.yaml --model-config config.json
    protrain-run --what-if configs/hardware/a100-80gb.yaml --largest

``--model-config`` prints what each placement of model state and activations needs (device, host
and SSD bytes per rank, predicted step time: ``memory_estimate``), then the plan the search picks
with its runners-up. ``--largest`` walks a GPT-3-shaped family from 1.3B to 175B parameters and
reports, for each, the fastest plan or what keeps it from fitting, then the largest that fits and
the resource that binds the next one. The search places activations as the runtime's does (keep,
swap, recompute); SSD joins it with ``ssd`` (as ``memory.ssd.path`` does at run time), at the
hardware file's disk rates.

The command line is read by ``protrain_launcher/what_if_cli.py``; this module plans and prints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from protrain.profiler.analytic import (
    KNOWN_CONFIGS,
    TransformerShape,
    analytic_profile,
    shape_from_config,
)
from protrain.profiler.host_bytes import ADAMW_STATES, checkpoint_staging_bytes
from protrain.profiler.plan import Plan, UpdateMode
from protrain.profiler.plan_builder import KnobRequest, searched_plan
from protrain.profiler.profile import ModelProfile
from protrain.profiler.search import NoPlanFitsError
from protrain.runtime.commands.memory_estimate import (
    Budgets,
    estimate_rows,
    estimate_table,
    needs_summary,
)
from protrain.runtime.commands.what_if_machine import Machine, machine_from_file, with_optimizer
from protrain.runtime.commands.what_if_request import SEARCHED_KNOBS, WhatIfRequest
from protrain.runtime.config.hardware_spec import HardwareFile, load_hardware
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.observability.console import plan_table

EXTRA_BUFFERS = 8
"""Buffers tried beyond the fewest that work: beyond a few, more only helps the first backward
chunks, and models of hundreds of chunks would otherwise mean millions of plans."""

MODEL_NAMES: tuple[str, ...] = tuple(KNOWN_CONFIGS)
"""Names ``--model-config`` takes in place of a file."""

# (name, layers, hidden, heads): GPT-3's shapes (Brown et al. 2020, table 2.1) and steps between.
GPT_FAMILY: tuple[tuple[str, int, int, int], ...] = (
    ("gpt-1.3b", 24, 2048, 16),
    ("gpt-2.7b", 32, 2560, 32),
    ("gpt-6.7b", 32, 4096, 32),
    ("gpt-13b", 40, 5120, 40),
    ("gpt-20b", 44, 6144, 48),
    ("gpt-30b", 48, 7168, 56),
    ("gpt-40b", 52, 8192, 64),
    ("gpt-50b", 64, 8192, 64),
    ("gpt-65b", 80, 8192, 64),
    ("gpt-75b", 80, 8704, 68),
    ("gpt-100b", 88, 9728, 76),
    ("gpt-130b", 96, 10752, 84),
    ("gpt-175b", 96, 12288, 96),
)


def profile_model(
    shape: TransformerShape,
    machine: Machine,
    *,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    frozen: tuple[str, ...] = (),
) -> ModelProfile:
    """The analytic profile of one micro-batch at the machine's sustained rate; ValueError for a
    sequence longer than the model's learned positions."""
    return analytic_profile(
        shape,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        precision=precision,
        sustained_flops=machine.sustained_flops,
        frozen=frozen,
    )


def plan_model(
    shape: TransformerShape,
    machine: Machine,
    *,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    ssd: bool = False,
    profile: ModelProfile | None = None,
    updates_after_norm: bool = False,
    keeps_gradients: bool = True,
    knobs: KnobRequest | None = None,
    chosen: tuple[str, ...] = SEARCHED_KNOBS,
    host_fixed_bytes: int = 0,
    optimizer_states: int = ADAMW_STATES,
) -> Plan:
    """The fastest plan that fits, or NoPlanFitsError saying why; ``ssd``: activations and
    optimizer state may go to the machine's disk (its rates must be known; within its capacity);
    ``updates_after_norm`` and ``keeps_gradients``
    as the spec's clipping, precision and accumulation set them (runtime.config.settings);
    ``knobs`` a job file's hand-set memory knobs; ``host_fixed_bytes`` what the host holds
    beside the plan (an async save's staging copy)."""
    if profile is None:
        profile = profile_model(shape, machine, micro_batch_size=micro_batch_size, seq_len=seq_len, precision=precision)
    plan, _ = searched_plan(
        request=knobs or KnobRequest(n_optimizer=None),
        model=profile,
        hardware=machine.hardware,
        num_blocks=shape.layers,
        micro_batch_size=micro_batch_size,
        device_budget_bytes=machine.device_budget,
        host_budget_bytes=machine.host_budget,
        chosen=chosen,
        extra_buffers=EXTRA_BUFFERS,
        ssd_available=ssd,
        # A what-if machine has a GPU: host work runs beside compute.
        update_mode=UpdateMode.of(
            keeps_gradients=keeps_gradients, updates_after_norm=updates_after_norm, host_beside_compute=True
        ),
        host_fixed_bytes=host_fixed_bytes,
        optimizer_states=optimizer_states,
        disk_room=machine.disk_bytes if ssd else None,
    )
    return plan


def family_shape(name: str, layers: int, hidden: int, heads: int, seq_len: int) -> TransformerShape:
    return TransformerShape(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        ffn=4 * hidden,
        vocab=50257,
        max_positions=max(2048, seq_len),
        gated_mlp=False,
        biases=True,
        learned_positions=True,
        tied_embeddings=True,
        norm_params=2,
    )


def run_what_if(request: WhatIfRequest) -> int:
    """Plan and print; returns protrain-run's exit code (1 when nothing fits). Bad input (a
    hardware file or model config that cannot be read, ``ssd`` without a disk, a job file's
    budget above the hardware's) raises SpecError."""
    hardware_file = load_hardware(request.hardware)
    machine = machine_for(request, hardware_file)
    console = Console(highlight=False)
    name = hardware_file.name
    if request.largest:
        return _largest(console, machine, name, request)
    assert request.model_config is not None, "the launcher requires --model-config or --largest"
    shape = _model_shape(request.model_config)
    try:
        profile = _profile_for(shape, machine, request)
    except ValueError as err:  # a sequence longer than the model's learned positions
        raise SpecError(f"--seq-len: {err}") from None
    if request.frozen and all(trainable for _, trainable in profile.param_sizes):
        raise SpecError(
            f"--frozen {' '.join(request.frozen)}: matches no parameter of {shape.name}; names are "
            "embed_tokens, embed_positions, layers.N.(norm_1|qkv|attn_out|norm_2|fc|proj|gate|up|down), "
            "final_norm, lm_head"
        )
    title = f"{shape.name} ({shape.parameters / 1e9:.2f}B parameters) on {name}"
    plan: Plan | None = None
    failure = ""
    try:
        plan = plan_for(shape, machine, request, profile)
    except NoPlanFitsError as err:
        failure = str(err)
    budgets = Budgets(device=machine.device_budget, host=machine.host_budget)
    rows = estimate_rows(
        profile,
        machine.hardware,
        updates_after_norm=request.updates_after_norm,
        keeps_gradients=request.keeps_gradients,
        optimizer_states=request.optimizer_states,
    )
    console.print(
        estimate_table(
            rows,
            plan,
            budgets,
            title=f"Memory estimate: {title}, batch {request.micro_batch_size} x {request.seq_len}, "
            f"{request.precision}, {request.update_words()}{_job_words(request)}; GiB per rank, budgets "
            f"{_gib(budgets.device)} device, {_gib(budgets.host)} host",
        )
    )
    console.print(
        needs_summary(
            rows,
            profile,
            shape.parameters,
            keeps_gradients=request.keeps_gradients,
            optimizer=request.optimizer_words(),
        )
    )
    if plan is None:
        console.print(f"[red]{shape.name} ({shape.parameters / 1e9:.2f}B) does not fit {name}:[/red] {failure}")
        return 1
    console.print(plan_table(plan, title=f"What-if plan: {title}"))
    return 0


def machine_for(request: WhatIfRequest, hardware_file: HardwareFile) -> Machine:
    """The hardware file's machine with a job file's hand-set budgets; SpecError where one
    exceeds the hardware, or for ``ssd`` without a disk."""
    if request.ssd and hardware_file.ssd is None:
        raise SpecError(f"{request.hardware}: --ssd needs the hardware file's ssd section (its disk rates)")
    machine = with_optimizer(machine_from_file(hardware_file), request.optimizer_rule)
    job = request.job
    if job is None:
        return machine
    gpu_memory = hardware_file.gpu.memory
    host_share = hardware_file.host.memory // hardware_file.gpu.count
    if job.device_budget is not None and job.device_budget > gpu_memory:
        raise SpecError(
            f"{request.config}: memory.device_budget: {_gib(job.device_budget)} is more than the "
            f"{_gib(gpu_memory)} GPU of {request.hardware}"
        )
    if job.host_budget is not None and job.host_budget > host_share:
        raise SpecError(
            f"{request.config}: memory.host_budget: {_gib(job.host_budget)} is more than a rank's "
            f"share of {request.hardware}'s host memory ({_gib(host_share)})"
        )
    return dataclasses.replace(
        machine,
        device_budget=machine.device_budget if job.device_budget is None else job.device_budget,
        host_budget=machine.host_budget if job.host_budget is None else job.host_budget,
    )


def _job_words(request: WhatIfRequest) -> str:
    words = []
    if request.frozen:
        words.append(f"frozen {', '.join(request.frozen)}")
    if request.job is not None and request.job.async_save:
        words.append("async saves staged on the host")
    if request.config:
        words.append(f"settings from {request.config}")
    return "".join(f", {word}" for word in words)


def _model_shape(model_config: str) -> TransformerShape:
    """The shape of a config.json, a directory holding one, or a known config's name."""
    path = Path(model_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists() and model_config in KNOWN_CONFIGS:
        config, name = KNOWN_CONFIGS[model_config], model_config
    else:
        config = _read_model_config(path)
        name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    try:
        return shape_from_config(config, name=name)
    except ValueError as err:
        raise SpecError(f"{path}: {err}") from None


def _profile_for(shape: TransformerShape, machine: Machine, request: WhatIfRequest) -> ModelProfile:
    return profile_model(
        shape,
        machine,
        micro_batch_size=request.micro_batch_size,
        seq_len=request.seq_len,
        precision=request.precision,
        frozen=request.frozen,
    )


def plan_for(
    shape: TransformerShape, machine: Machine, request: WhatIfRequest, profile: ModelProfile | None = None
) -> Plan:
    """The plan the request gets for ``shape`` on ``machine`` (an async save's staging counted
    beside it), or NoPlanFitsError."""
    if profile is None:
        profile = _profile_for(shape, machine, request)
    staging = (
        checkpoint_staging_bytes(
            list(profile.param_sizes),
            element_size=profile.element_size,
            world_size=machine.hardware.world_size,
            optimizer_states=request.optimizer_states,
        )
        if request.job is not None and request.job.async_save
        else 0
    )
    return plan_model(
        shape,
        machine,
        micro_batch_size=request.micro_batch_size,
        seq_len=request.seq_len,
        precision=request.precision,
        ssd=request.ssd,
        profile=profile,
        updates_after_norm=request.updates_after_norm,
        keeps_gradients=request.keeps_gradients,
        knobs=None if request.job is None else request.job.knobs,
        chosen=SEARCHED_KNOBS if request.job is None else request.job.chosen,
        host_fixed_bytes=staging,
        optimizer_states=request.optimizer_states,
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def _largest(console: Console, machine: Machine, name: str, request: WhatIfRequest) -> int:
    table = Table(
        title=f"What-if: GPT-family models on {name}, batch {request.micro_batch_size} x "
        f"{request.seq_len}, {request.precision}, {request.update_words()}{_job_words(request)}, "
        "activations placed by the search; GiB per rank",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for column in ("model", "params", "fits", "step s", "tokens/s", "device", "host", "nvme", "binds"):
        table.add_column(column, no_wrap=True, justify="left" if column in ("model", "binds") else "right")
    largest: tuple[str, int] | None = None
    first_miss: str | None = None
    for shape in _family(request.seq_len):
        size = f"{shape.parameters / 1e9:.1f}B"
        try:
            plan = plan_for(shape, machine, request)
        except NoPlanFitsError as err:
            reason = "host memory" if "host budget" in str(err) else "device memory"
            table.add_row(shape.name, size, "no", "", "", "", "", "", reason)
            first_miss = first_miss or f"{shape.name} ({size}): {err}"
            continue
        step = plan.predicted_step_s or 0.0
        table.add_row(
            shape.name,
            size,
            "yes",
            f"{step:.2f}",
            f"{request.micro_batch_size * request.seq_len / step:,.0f}" if step else "",
            f"{(plan.predicted_peak_device_bytes or 0) / 2**30:.1f}",
            f"{(plan.predicted_peak_host_bytes or 0) / 2**30:.0f}",
            f"{(plan.predicted_nvme_bytes or 0) / 2**30:.0f}" if plan.predicted_nvme_bytes else "",
            plan.rule.rsplit("; ", 1)[-1].split(":")[0],  # the binding, after the layout words
        )
        largest = (shape.name, shape.parameters)
    console.print(table)
    # The other clipping case too: the Hugging Face Trainer clips by default, the spec does not,
    # and the answer differs by a model size where host memory binds.
    other = dataclasses.replace(
        request,
        clipping=not request.clipping,
        clipping_from="--clipping" if not request.clipping else "--no-clipping",
    )
    other_largest = _largest_that_fits(machine, other)
    if largest is None:
        console.print("[red]no model of the family fits[/red]" + (f": {first_miss}" if first_miss else ""))
    else:
        console.print(f"largest that fits: {largest[0]} ({largest[1] / 1e9:.1f}B parameters), {request.update_words()}")
    console.print(
        "with clipping "
        + ("off" if request.clipping else "on")
        + (
            f" instead: {other_largest[0]} ({other_largest[1] / 1e9:.1f}B parameters), {other.update_words()}"
            if other_largest
            else f": none fits, {other.update_words()}"
        )
    )
    if first_miss:
        console.print(f"first that does not: {first_miss}")
    return 0 if largest is not None else 1


def _family(seq_len: int) -> list[TransformerShape]:
    return [family_shape(name, layers, hidden, heads, seq_len) for name, layers, hidden, heads in GPT_FAMILY]


def _largest_that_fits(machine: Machine, request: WhatIfRequest) -> tuple[str, int] | None:
    largest = None
    for shape in _family(request.seq_len):
        try:
            plan_for(shape, machine, request)
        except NoPlanFitsError:
            continue
        largest = (shape.name, shape.parameters)
    return largest


def _read_model_config(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except OSError as err:
        raise SpecError(f"{path}: cannot read ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"{path}: not JSON: {err.msg} at line {err.lineno}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a JSON object (a model config)")
    return data

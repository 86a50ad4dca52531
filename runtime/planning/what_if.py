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

import json
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from profiler.analytic import KNOWN_CONFIGS, TransformerShape, analytic_profile, shape_from_config
from profiler.plan import Plan
from profiler.plan_builder import KnobRequest, searched_plan
from profiler.profile import HardwareProfile, ModelProfile
from profiler.search import NoPlanFitsError
from runtime.config.hardware_spec import HardwareFile, load_hardware
from runtime.config.settings import keeps_gradients
from runtime.config.spec_io import SpecError
from runtime.console import plan_table
from runtime.planning.memory_estimate import Budgets, estimate_rows, estimate_table, needs_summary

DEVICE_RESERVE_FRACTION = 0.05
"""As runtime/planning/budgets.py: kept free on a CUDA device for the context, NCCL and allocator slack."""
HOST_RESERVE_BYTES = 2 << 30
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


@dataclass(frozen=True, slots=True, kw_only=True)
class WhatIfRequest:
    """One what-if question: a hardware file, and a model config or the whole GPT family."""

    hardware: str
    """The hardware file, as the user wrote it (errors name it so)."""
    model_config: str | None
    """A config.json path, a directory holding one, or a known config name; None with ``largest``."""
    largest: bool
    micro_batch_size: int
    seq_len: int
    precision: str
    ssd: bool = False
    """Let the search put activations on the hardware file's disk (it must describe one)."""
    clipping: bool = False
    """Plan for gradient clipping (the update waits for the norm; gradients are kept)."""
    accumulation_steps: int = 1

    @property
    def updates_after_norm(self) -> bool:
        return self.clipping or self.precision == "fp16"

    @property
    def keeps_gradients(self) -> bool:
        return keeps_gradients(
            gradient_clipping=1.0 if self.clipping else 0.0,
            loss_scaled=self.precision == "fp16",
            accumulation_steps=self.accumulation_steps,
        )

    def update_words(self) -> str:
        """The update case assumed, for the tables' titles."""
        clipping = "clipping on" if self.clipping else "clipping off"
        window = f", {self.accumulation_steps} micro-batches a window" if self.accumulation_steps > 1 else ""
        held = "16" if self.keeps_gradients else "12"
        kept = "gradients kept" if self.keeps_gradients else "gradients applied as they arrive"
        return f"{clipping}{window}: {kept}, {held} host bytes per offloaded parameter"


@dataclass(frozen=True, slots=True)
class Machine:
    hardware: HardwareProfile
    device_budget: int
    host_budget: int
    sustained_flops: float


def machine_from_file(spec: HardwareFile) -> Machine:
    gpu = spec.gpu
    world = gpu.count
    collective = float(gpu.collective_bandwidth) if world > 1 else float("inf")
    hardware = HardwareProfile(
        device_kind=f"what-if:{gpu.name}",
        world_size=world,
        h2d_bytes_per_s=float(gpu.host_to_device),
        d2h_bytes_per_s=float(gpu.device_to_host),
        cpu_adam_params_per_s=spec.host.cpu_adam_params_per_s,
        # Device AdamW reads and writes ~28 bytes per parameter: bound by memory bandwidth.
        device_adam_params_per_s=gpu.memory_bandwidth / 28,
        all_gather_bytes_per_s=collective,
        reduce_scatter_bytes_per_s=collective,
        collective_latency_s=20e-6 if world > 1 else 0.0,
        adam_segment_s=10e-6,  # a fused multi-tensor kernel launch per few parameters
        memory_bytes_per_s=float(gpu.memory_bandwidth) / 2,  # a copy reads and writes
        copies_overlap_compute=True,
        ssd_write_bytes_per_s=float(spec.ssd.write_bandwidth) if spec.ssd else 0.0,
        ssd_read_bytes_per_s=float(spec.ssd.read_bandwidth) if spec.ssd else 0.0,
    )
    return Machine(
        hardware=hardware,
        device_budget=int(gpu.memory * (1 - DEVICE_RESERVE_FRACTION)),
        host_budget=max(0, spec.host.memory - HOST_RESERVE_BYTES) // world,
        sustained_flops=gpu.tflops * 1e12 * gpu.mfu,
    )


def profile_model(
    shape: TransformerShape, machine: Machine, *, micro_batch_size: int, seq_len: int, precision: str
) -> ModelProfile:
    """The analytic profile of one micro-batch at the machine's sustained rate; ValueError for a
    sequence longer than the model's learned positions."""
    return analytic_profile(
        shape,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        precision=precision,
        sustained_flops=machine.sustained_flops,
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
) -> Plan:
    """The fastest plan that fits, or NoPlanFitsError saying why; ``ssd``: activations may go to
    the machine's disk (its rates must be known); ``updates_after_norm`` and ``keeps_gradients``
    as the spec's clipping, precision and accumulation set them (runtime.config.settings)."""
    if profile is None:
        profile = profile_model(
            shape, machine, micro_batch_size=micro_batch_size, seq_len=seq_len, precision=precision
        )
    plan, _ = searched_plan(
        request=KnobRequest(),
        model=profile,
        hardware=machine.hardware,
        num_blocks=shape.layers,
        micro_batch_size=micro_batch_size,
        device_budget_bytes=machine.device_budget,
        host_budget_bytes=machine.host_budget,
        chosen=("memory.chunk_size", "memory.n_persist", "memory.n_buffer"),
        extra_buffers=EXTRA_BUFFERS,
        ssd_available=ssd,
        updates_after_norm=updates_after_norm,
        keeps_gradients=keeps_gradients,
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
    hardware file or model config that cannot be read, ``ssd`` without a disk) raises SpecError."""
    hardware_file = load_hardware(request.hardware)
    if request.ssd and hardware_file.ssd is None:
        raise SpecError(f"{request.hardware}: --ssd needs the hardware file's ssd section (its disk rates)")
    machine = machine_from_file(hardware_file)
    console = Console(highlight=False)
    name = hardware_file.name
    if request.largest:
        return _largest(console, machine, name, request)
    assert request.model_config is not None, "the launcher requires --model-config or --largest"
    shape = _model_shape(request.model_config)
    try:
        profile = profile_model(
            shape,
            machine,
            micro_batch_size=request.micro_batch_size,
            seq_len=request.seq_len,
            precision=request.precision,
        )
    except ValueError as err:  # a sequence longer than the model's learned positions
        raise SpecError(f"--seq-len: {err}") from None
    title = f"{shape.name} ({shape.parameters / 1e9:.2f}B parameters) on {name}"
    plan: Plan | None = None
    failure = ""
    try:
        plan = _plan_for(shape, machine, request, profile)
    except NoPlanFitsError as err:
        failure = str(err)
    budgets = Budgets(device=machine.device_budget, host=machine.host_budget)
    rows = estimate_rows(
        profile,
        machine.hardware,
        updates_after_norm=request.updates_after_norm,
        keeps_gradients=request.keeps_gradients,
    )
    console.print(
        estimate_table(
            rows,
            plan,
            budgets,
            title=f"Memory estimate: {title}, batch {request.micro_batch_size} x {request.seq_len}, "
            f"{request.precision}, {request.update_words()}; GiB per rank, budgets "
            f"{_gib(budgets.device)} device, {_gib(budgets.host)} host",
        )
    )
    console.print(needs_summary(rows, profile, shape.parameters, keeps_gradients=request.keeps_gradients))
    if plan is None:
        console.print(
            f"[red]{shape.name} ({shape.parameters / 1e9:.2f}B) does not fit {name}:[/red] {failure}"
        )
        return 1
    console.print(plan_table(plan, title=f"What-if plan: {title}"))
    return 0


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


def _plan_for(
    shape: TransformerShape, machine: Machine, request: WhatIfRequest, profile: ModelProfile | None = None
) -> Plan:
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
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def _largest(console: Console, machine: Machine, name: str, request: WhatIfRequest) -> int:
    table = Table(
        title=f"What-if: GPT-family models on {name}, batch {request.micro_batch_size} x "
        f"{request.seq_len}, {request.precision}, {request.update_words()}, activations placed by "
        "the search; GiB per rank",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for column in ("model", "params", "fits", "step s", "tokens/s", "device", "host", "binds"):
        table.add_column(column, no_wrap=True, justify="left" if column in ("model", "binds") else "right")
    largest: tuple[str, int] | None = None
    first_miss: str | None = None
    for family_name, layers, hidden, heads in GPT_FAMILY:
        shape = family_shape(family_name, layers, hidden, heads, request.seq_len)
        size = f"{shape.parameters / 1e9:.1f}B"
        try:
            plan = _plan_for(shape, machine, request)
        except NoPlanFitsError as err:
            reason = "host memory" if "host budget" in str(err) else "device memory"
            table.add_row(family_name, size, "no", "", "", "", "", reason)
            first_miss = first_miss or f"{family_name} ({size}): {err}"
            continue
        step = plan.predicted_step_s or 0.0
        table.add_row(
            family_name,
            size,
            "yes",
            f"{step:.2f}",
            f"{request.micro_batch_size * request.seq_len / step:,.0f}" if step else "",
            f"{(plan.predicted_peak_device_bytes or 0) / 2**30:.1f}",
            f"{(plan.predicted_peak_host_bytes or 0) / 2**30:.0f}",
            plan.rule.rsplit("; ", 1)[-1].split(":")[0],  # the binding, after the layout words
        )
        largest = (family_name, shape.parameters)
    console.print(table)
    if largest is None:
        console.print("[red]no model of the family fits[/red]" + (f": {first_miss}" if first_miss else ""))
        return 1
    console.print(
        f"largest that fits: {largest[0]} ({largest[1] / 1e9:.1f}B parameters), {request.update_words()}"
        + ("" if request.keeps_gradients else " (--clipping plans for gradient clipping)")
    )
    if first_miss:
        console.print(f"first that does not: {first_miss}")
    return 0


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

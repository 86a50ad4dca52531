"""The environment report (``protrain-run --report``): what a bug report needs to know about the
machine, like DeepSpeed's ``ds_report`` and ``python -m torch.utils.collect_env``.

Sections: software versions (``software``), GPUs (``gpus``), the CPU and host memory with its
limits (``host``), the disk under ``--ssd-path`` and the profile cache (``storage``), and the
environment variables that steer torch, CUDA, NCCL and ProTrain. Every probe that fails becomes a
row saying why (``rows.run_probe``), so the report always completes, with or without a GPU.

Importing this package loads neither torch nor the planner (the launcher imports it); the probes
import torch when they run. The launcher renders the sections as tables or JSON.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protrain.runtime.commands.env_report.gpus import gpu_rows
from protrain.runtime.commands.env_report.host import cpu_rows, memory_rows
from protrain.runtime.commands.env_report.rows import Row, Section, Status, run_probe
from protrain.runtime.commands.env_report.software import software_rows
from protrain.runtime.commands.env_report.storage import cache_rows, ssd_rows
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.config.spec_types import parse_size

__all__ = ["ReportOptions", "Row", "Section", "Status", "collect_report", "parse_probe_size", "report_json"]

DEFAULT_SSD_PROBE_BYTES = 64 << 20
"""As the planner measures ``memory.ssd.path`` (``hardware_probes.DISK_PROBE_BYTES``)."""
ENV_PREFIXES = (
    "PROTRAIN_",
    "CUDA_",
    "NCCL_",
    "TORCH_",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "KMP_",
    "HF_",
    "TRANSFORMERS_",
)
"""Environment variables that change what torch, CUDA, NCCL, Hugging Face or ProTrain do."""
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
"""A variable whose name holds one of these is reported as set, never with its value."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportOptions:
    cache_dir: Path
    """``profiler.cache_dir`` of the spec (or its default)."""
    cache_source: str = "the default"
    """Where ``cache_dir`` came from, in words (the spec file, or the default)."""
    ssd_path: Path | None = None
    """Measure the disk under this folder; None: not measured."""
    ssd_probe_bytes: int = DEFAULT_SSD_PROBE_BYTES
    spec_ssd_path: str | None = None
    """The spec's ``memory.ssd.path``, named when ``ssd_path`` is not given."""


def collect_report(options: ReportOptions) -> list[Section]:
    return [
        Section("Software", run_probe("software", software_rows)),
        Section("GPUs", run_probe("GPUs", gpu_rows)),
        Section("CPU", run_probe("CPU", cpu_rows)),
        Section("Host memory", run_probe("memory", memory_rows)),
        Section(
            "SSD",
            run_probe(
                "SSD",
                lambda: ssd_rows(options.ssd_path, options.ssd_probe_bytes, spec_path=options.spec_ssd_path),
            ),
        ),
        Section(
            f"Profile cache (profiler.cache_dir from {options.cache_source})",
            run_probe("profile cache", lambda: cache_rows(options.cache_dir)),
        ),
        Section("Environment variables", run_probe("environment", environment_rows)),
    ]


def parse_probe_size(text: str) -> int:
    """``--ssd-probe-size``: a size such as "64MiB", at least one 4 KiB block; SpecError if not."""
    try:
        size = parse_size(text)
    except (TypeError, ValueError):
        size = 0
    if size < 4096:
        raise SpecError(f'--ssd-probe-size: got {text!r}; allowed: a size of at least 4 KiB, such as "64MiB"')
    return size


def report_json(sections: list[Section]) -> dict[str, Any]:
    return {"protrain_report": 1, "sections": [section.to_json() for section in sections]}


def environment_rows() -> list[Row]:
    names = sorted(name for name in os.environ if name.startswith(ENV_PREFIXES))
    if not names:
        return [Row("(none)", "no variable starting with " + ", ".join(ENV_PREFIXES) + " is set")]
    rows = []
    for name in names:
        if any(word in name.upper() for word in SECRET_WORDS):
            rows.append(Row(name, "(set; value not shown)"))
        else:
            rows.append(Row(name, os.environ[name], os.environ[name]))
    return rows

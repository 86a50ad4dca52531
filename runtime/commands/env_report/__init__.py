"""The environment report (``protrain-run --report``), like DeepSpeed's ``ds_report``: versions, GPUs,
CPU, host memory and its limits, disks, and the environment variables that steer torch, CUDA, NCCL
and ProTrain. Importing it loads no torch (the launcher imports it); the probes import torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protrain.runtime.commands.env_report.host import cache_rows, cpu_rows, memory_rows, ssd_rows
from protrain.runtime.commands.env_report.rows import Row, Section, Status, run_probe
from protrain.runtime.commands.env_report.software import gpu_rows, software_rows
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.config.spec_types import parse_size

__all__ = ["ReportOptions", "Row", "Section", "Status", "collect_report", "parse_probe_size", "report_json"]

DEFAULT_SSD_PROBE_BYTES = 64 << 20  # as the planner measures memory.ssd.path (hardware_probes.DISK_PROBE_BYTES)
ENV_PREFIXES = ("PROTRAIN_", "CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "HF_", "TRANSFORMERS_")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")  # such a variable is named, its value not shown


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportOptions:
    cache_dir: Path  # the spec's profiler.cache_dir (or its default)
    cache_source: str = "the default"  # where cache_dir came from, in words
    ssd_path: Path | None = None  # measure the disk under this folder; None: not measured
    ssd_probe_bytes: int = DEFAULT_SSD_PROBE_BYTES
    spec_ssd_path: str | None = None  # the spec's memory.ssd.path, named when ssd_path is not given


def collect_report(options: ReportOptions) -> list[Section]:
    def ssd() -> list[Row]:
        return ssd_rows(options.ssd_path, options.ssd_probe_bytes, spec_path=options.spec_ssd_path)

    cache = f"Profile cache (profiler.cache_dir from {options.cache_source})"
    return [
        Section("Software", run_probe("software", software_rows)),
        Section("GPUs", run_probe("GPUs", gpu_rows)),
        Section("CPU", run_probe("CPU", cpu_rows)),
        Section("Host memory", run_probe("memory", memory_rows)),
        Section("SSD", run_probe("SSD", ssd)),
        Section(cache, run_probe("profile cache", lambda: cache_rows(options.cache_dir))),
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
    body = [{"title": section.title, "rows": [row.to_json() for row in section.rows]} for section in sections]
    return {"protrain_report": 2, "sections": body}


def environment_rows() -> list[Row]:
    names = sorted(name for name in os.environ if name.startswith(ENV_PREFIXES))
    if not names:
        return [Row("(none)", "no variable starting with " + ", ".join(ENV_PREFIXES) + " is set")]
    secret = {name for name in names if any(word in name.upper() for word in SECRET_WORDS)}
    return [Row(name, "(set; value not shown)") if name in secret else Row(name, os.environ[name]) for name in names]

"""The peak FLOPS MFU divides by: dense tensor-core throughput of common GPUs, per compute dtype.

Figures are the vendors' datasheet numbers without structured sparsity (which halves nothing a
dense matmul does), in TFLOPS per GPU; for GeForce cards, fp16/bf16 with fp32 accumulation
(what PyTorch's matmuls accumulate in), half the rate those cards reach accumulating in fp16.
fp32 compute counts at the TF32 rate when PyTorch lets matmuls use TF32
(``torch.backends.cuda.matmul.allow_tf32``), else at the plain fp32 rate.

A card whose SM clock NVML reports below the figure's boost clock (``BOOST_MHZ``) is held to its
share. ``PROTRAIN_PEAK_TFLOPS`` (a number of TFLOPS per device) overrides the table: for a GPU it does not
know, a clock-limited card, or to report MFU on CPU, where there is none otherwise.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from protrain.runtime.config.spec import Precision
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.nvml import max_sm_clock_mhz

PEAK_TFLOPS_ENV = "PROTRAIN_PEAK_TFLOPS"

_HOPPER = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}
_HOPPER_NVL = {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}

PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    # (name, pattern matched against the device name, TFLOPS by dtype); the first match wins.
    ("H100 NVL", r"H100.*NVL", _HOPPER_NVL),
    ("H100 PCIe", r"H100.*PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100 SXM", r"H100", _HOPPER),
    ("H200 NVL", r"H200.*NVL", _HOPPER_NVL),
    ("H200", r"H200", _HOPPER),
    ("B200", r"B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0}),
    ("A100", r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A10", r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("L40S", r"L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    ("L4", r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("RTX 4090", r"RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("RTX 3090", r"RTX 3090(?!\s*Ti)", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    ("V100", r"V100", {"fp16": 125.0, "fp32": 15.7}),
)


BOOST_MHZ: dict[str, int] = {
    "H100 NVL": 1785,
    "H100 PCIe": 1755,
    "H100 SXM": 1980,
    "H200 NVL": 1785,
    "H200": 1980,
    "B200": 1965,
    "A100": 1410,
    "A10": 1695,
    "L40S": 2520,
    "L4": 2040,
    "RTX 4090": 2520,
    "RTX 3090": 1695,
    "V100": 1530,
}
"""The boost SM clock each table figure is quoted at: a card whose clock NVML says is lower (an
application clock set, a capped card) is held to its share of the figure."""


@dataclass(frozen=True, slots=True)
class PeakFlops:
    tflops: float | None
    """Per device; None: unknown (no MFU)."""
    source: str
    """Where it came from, or why it is unknown: printed once at the start."""


def compute_dtype_name(precision: Precision, *, tf32: bool) -> str:
    """The table's dtype for a run at ``precision`` (``tf32``: fp32 matmuls may use TF32)."""
    if precision is Precision.FP32:
        return "tf32" if tf32 else "fp32"
    return precision.value


def table_tflops(device_name: str, dtype: str) -> tuple[str, float] | None:
    """(the table's name for the GPU, its TFLOPS at ``dtype``), or None when not in the table."""
    for name, pattern, by_dtype in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return (name, by_dtype[dtype]) if dtype in by_dtype else None
    return None


def peak_flops(device: DeviceInfo, precision: Precision) -> PeakFlops:
    """The peak for this run: ``PROTRAIN_PEAK_TFLOPS``, else the table's for this GPU and dtype."""
    override = os.environ.get(PEAK_TFLOPS_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            value = 0.0
        if not value > 0.0 or value == float("inf"):
            raise ValueError(f"{PEAK_TFLOPS_ENV} must be a positive number of TFLOPS, got {override!r}")
        return PeakFlops(value, f"{PEAK_TFLOPS_ENV}={override}")
    if not device.is_cuda:
        return PeakFlops(None, f"no peak FLOPS on CPU (set {PEAK_TFLOPS_ENV} for MFU)")
    gpu = torch.cuda.get_device_name(device.device)
    dtype = compute_dtype_name(precision, tf32=torch.backends.cuda.matmul.allow_tf32)
    found = table_tflops(gpu, dtype)
    if found is None:
        return PeakFlops(None, f"no peak FLOPS known for {gpu} at {dtype}: set {PEAK_TFLOPS_ENV} for MFU")
    name, tflops = found
    boost, clock = BOOST_MHZ.get(name), max_sm_clock_mhz(device.device)
    if boost is not None and clock is not None and clock < boost:
        held = tflops * clock / boost
        return PeakFlops(held, f"{name} {dtype} peak {tflops:g} TFLOPS at {boost} MHz, {held:.1f} at its {clock} MHz")
    return PeakFlops(tflops, f"{name} {dtype} peak {tflops:g} TFLOPS")

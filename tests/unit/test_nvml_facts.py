"""What NVML tells the runtime where torch cannot see (runtime/hw/nvml.py), on a stand-in pynvml and a
stand-in CUDA device (this machine has neither): the processes holding the GPU's memory when the
device budget is auto, the SM clock the MFU peak is held to, the PCIe link in the plan's notes;
and the dependencies the design card lists are the package's own."""

from __future__ import annotations

import os
import sys
from importlib.metadata import requires
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from protrain.profiler.plan_builder import transfer_notes
from protrain.profiler.profile import HardwareProfile
from protrain.runtime.config.spec import Precision
from protrain.runtime.hw.device import DeviceInfo
from protrain.runtime.hw.nvml import describe_link, other_processes, pcie_link
from protrain.runtime.observability.peak_flops import peak_flops
from protrain.runtime.planning import budgets

GIB = 1 << 30
CUDA = DeviceInfo(torch.device("cuda", 0), "nccl")


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """An H100 on bus 0000:18:00.0: 80 GiB, 20 GiB free, 2 GiB cached by this process; another
    process holds 50 GiB, this one 10 GiB; its application clock is set to 1200 MHz."""
    state = SimpleNamespace(app_clock=1200, bus_seen=[])
    module = ModuleType("pynvml")
    module.NVML_CLOCK_SM = 1  # type: ignore[attr-defined]
    module.nvmlInit = lambda: None  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]

    def handle(bus: str) -> str:
        state.bus_seen.append(bus)
        return "h100"

    module.nvmlDeviceGetHandleByPciBusId = handle  # type: ignore[attr-defined]
    module.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        SimpleNamespace(pid=os.getpid(), usedGpuMemory=10 * GIB),
        SimpleNamespace(pid=1, usedGpuMemory=50 * GIB),
    ]
    module.nvmlDeviceGetApplicationsClock = lambda h, clock: state.app_clock  # type: ignore[attr-defined]
    module.nvmlDeviceGetMaxClockInfo = lambda h, clock: 1980  # type: ignore[attr-defined]
    module.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5  # type: ignore[attr-defined]
    module.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", module)
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x18, pci_device_id=0, total_memory=80 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    return state


def test_an_auto_budget_is_what_is_free_and_names_who_holds_the_rest(
    gpu: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: 95% of the card's 80 GiB whatever else ran there (an out-of-memory error at the
    first step beside another job); now what is free for this process, less the reserve."""
    budget = budgets.auto_device_budget(CUDA, ranks_on_host=1)
    assert budget == 20 * GIB + 2 * GIB - int(80 * GIB * budgets.DEVICE_RESERVE_FRACTION)
    out = capsys.readouterr().out
    assert "other processes hold memory there: pid 1 " in out and "(50.0 GiB)" in out
    assert f"pid {os.getpid()}" not in out, "this process is not another"
    assert gpu.bus_seen[0] == "00000000:18:00.0"
    assert [p.pid for p in other_processes(CUDA.device)] == [1]


def test_the_mfu_peak_is_held_to_the_clock_the_gpu_may_run_at(gpu: SimpleNamespace) -> None:
    held = peak_flops(CUDA, Precision.BF16)
    assert held.tflops == pytest.approx(989.4 * 1200 / 1980)
    assert "1200 MHz" in held.source
    gpu.app_clock = 1980
    assert peak_flops(CUDA, Precision.BF16).tflops == pytest.approx(989.4)


def test_the_plan_notes_the_link_its_transfer_rates_ran_over(gpu: SimpleNamespace) -> None:
    link = describe_link(pcie_link(CUDA.device))
    assert link == "PCIe gen 5 x16 (63.0 GB/s each way)"
    hardware = HardwareProfile(
        device_kind="cuda:H100",
        world_size=1,
        h2d_bytes_per_s=24e9,
        d2h_bytes_per_s=25e9,
        cpu_adam_params_per_s=1e9,
        device_adam_params_per_s=1e10,
        all_gather_bytes_per_s=float("inf"),
        reduce_scatter_bytes_per_s=float("inf"),
        collective_latency_s=0.0,
        link=link,
    )
    assert transfer_notes(hardware) == (
        "transfers: host->device 24.0 GB/s, device->host 25.0 GB/s measured over PCIe gen 5 x16 "
        "(63.0 GB/s each way)",
    )


def test_without_nvml_each_fact_is_unknown_and_nothing_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> Any:
        raise RuntimeError("NVML Shared Library Not Found")

    module = ModuleType("pynvml")
    module.nvmlInit = no_driver  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert other_processes(CUDA.device) == [] and pcie_link(CUDA.device) is None


def test_accelerate_and_nvidia_ml_py_are_dependencies_not_extras() -> None:
    """The demo's meta-device build needs accelerate and the report and budgets use NVML: both
    are installed with the package (before: accelerate only with an extra, so the CPU demo died
    with a traceback without it, and nvidia-ml-py nowhere)."""
    core = {line.split(">")[0].split("=")[0].strip() for line in requires("protrain") or [] if "extra ==" not in line}
    assert {"accelerate", "nvidia-ml-py"} <= core, core


def test_a_missing_optional_package_is_one_line_naming_the_extra(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank whose script needs an extra's package gets one line and exit 2, not a traceback;
    any other missing module is the script's own error and raises as it did."""
    from protrain.launcher.rank_entry import ERROR_FILE_ENV, run_script

    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    script = tmp_path / "train.py"
    script.write_text("raise ModuleNotFoundError(\"No module named 'tensorboard'\", name='tensorboard')\n")
    assert run_script(str(script), []) == 2
    err = capsys.readouterr().err
    assert err.strip() == "protrain-run: error: tensorboard is not installed: pip install 'protrain[logging]'"
    script.write_text("import no_such_module_here\n")
    with pytest.raises(ModuleNotFoundError):
        run_script(str(script), [])

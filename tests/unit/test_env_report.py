"""``protrain-run --report``: the environment report, in-process through the launcher's ``main``
(tables and JSON), its probes on hand-made /proc, /sys and NVML, the disk probe under
``--ssd-path``, the profile cache, and one real ``protrain-run --report`` process."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest
import torch

from protrain.profiler.analytic import KNOWN_CONFIGS, analytic_profile, shape_from_config
from protrain.profiler.profile import PROFILE_VERSION, HardwareProfile
from protrain.launcher.cli import main
from protrain.runtime.commands.env_report import host
from protrain.runtime.commands.env_report.gpus import gpu_rows, sysfs_bus_id
from protrain.runtime.commands.env_report.host import cgroup_limit, cgroup_row, cpu_ranges, cpu_rows, simd_row
from protrain.runtime.commands.env_report.rows import Status, format_age, run_probe

GIB = 1 << 30


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, dict[str, dict[str, Any]]]:
    """``protrain-run --report --json ...`` in-process: section title -> row name -> row."""
    assert main(["--report", "--json", *argv]) == 0
    body = json.loads(capsys.readouterr().out)
    return {
        section["title"].split(" (")[0]: {row["name"]: row for row in section["rows"]}
        for section in body["sections"]
    }


def test_the_report_tells_what_this_machine_is(capsys: pytest.CaptureFixture[str]) -> None:
    sections = report(capsys)
    assert set(sections) == {
        "Software",
        "GPUs",
        "CPU",
        "Host memory",
        "SSD",
        "Profile cache",
        "Environment variables",
    }
    software, cpu, memory = sections["Software"], sections["CPU"], sections["Host memory"]
    assert software["python"]["value"] == platform.python_version()
    assert software["torch"]["value"] == torch.__version__
    assert software["pydantic"]["value"] == __import__("pydantic").VERSION
    assert software["protrain"]["value"]["version"] == "0.1.0"
    if torch.version.cuda is None:  # this machine: the CPU build, no GPU, exit 0 all the same
        assert "CPU-only build" in software["torch CUDA"]["text"]
        assert sections["GPUs"]["CUDA devices"]["value"] == 0
    assert cpu["CPU affinity"]["value"] == sorted(os.sched_getaffinity(0))
    assert cpu["cores"]["value"]["logical"] == os.cpu_count()
    assert memory["RAM"]["value"]["total"] == psutil.virtual_memory().total
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert memory["memory lock limit"]["value"]["soft"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert "cgroup memory limit" in memory and "/dev/shm" in memory
    assert "not measured: give --ssd-path DIR" in sections["SSD"]["SSD path"]["text"]
    assert not [
        row for section in sections.values() for row in section.values() if row.get("status") == "failed"
    ]


def test_simd_agrees_with_what_torch_dispatches_to(capsys: pytest.CaptureFixture[str]) -> None:
    """/proc/cpuinfo's flags, read by the report, against ATen's own detection of the CPU."""
    simd = report(capsys)["CPU"]["SIMD"]["value"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        assert simd["AVX-512"] and simd["AVX2"]
    elif capability == "AVX2":
        assert simd["AVX2"]
    else:
        pytest.skip(f"ATen reports {capability}: nothing to compare")


def test_the_tables_print_and_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--report"]) == 0
    out = capsys.readouterr().out
    for title in ("Software", "GPUs", "CPU", "Host memory", "SSD", "Profile cache", "Environment variables"):
        assert title in out
    assert "probe(s) failed" not in out


def test_a_failing_probe_is_a_row_saying_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken() -> None:
        raise RuntimeError("no /proc/meminfo")

    monkeypatch.setattr(host.psutil, "virtual_memory", broken)
    rows = report(capsys)["Host memory"]
    assert rows["memory"] == {
        "name": "memory",
        "text": "probe failed: RuntimeError: no /proc/meminfo",
        "status": "failed",
    }
    assert main(["--report"]) == 0
    assert "1 probe(s) failed" in capsys.readouterr().out
    assert run_probe("x", lambda: [][0])[0].text == "probe failed: IndexError: list index out of range"


def test_the_disk_under_ssd_path_is_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    rows = report(capsys, "--ssd-path", str(tmp_path), "--ssd-probe-size", "1MiB")["SSD"]
    assert time.perf_counter() - started < 10
    assert rows["SSD path"]["text"] == str(tmp_path.resolve())
    assert isinstance(rows["O_DIRECT"]["value"], bool)
    assert rows["write rate"]["value"] > 0 and rows["read rate"]["value"] > 0
    assert "(1.0 MiB, fsync'd)" in rows["write rate"]["text"]
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    assert rows["filesystem"]["value"]["type"] in {fields[2] for fields in mounts}
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_a_missing_ssd_path_is_reported_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nvme"
    rows = report(capsys, "--ssd-path", str(missing), "--set", "memory.ssd.path=/mnt/nvme")["SSD"]
    assert rows["SSD path"] == {"name": "SSD path", "text": f"{missing} does not exist", "status": "failed"}
    assert not missing.exists()
    rows = report(capsys, "--set", "memory.ssd.path=/mnt/nvme")["SSD"]
    assert "(the spec's memory.ssd.path is /mnt/nvme)" in rows["SSD path"]["text"]


def test_bad_report_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--report", "--ssd-probe-size", "1KB"]) == 2
    assert "--ssd-probe-size: got '1KB'; allowed: a size of at least 4 KiB" in capsys.readouterr().err
    assert main(["--report", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
    assert main(["--report", "--frobnicate"]) == 2
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err


def test_profile_cache_entries_with_their_age(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    now = time.time()
    hardware = HardwareProfile(
        device_kind="cuda:NVIDIA H100 80GB HBM3",
        world_size=2,
        h2d_bytes_per_s=25e9,
        d2h_bytes_per_s=25e9,
        cpu_adam_params_per_s=1.5e9,
        device_adam_params_per_s=1e11,
        all_gather_bytes_per_s=1e11,
        reduce_scatter_bytes_per_s=1e11,
        collective_latency_s=1e-5,
    )
    (cache / "hardware-aa.json").write_text(json.dumps(hardware.to_dict()))
    os.utime(cache / "hardware-aa.json", (now - 7300, now - 7300))
    shape = shape_from_config(KNOWN_CONFIGS["gpt2"])
    model = analytic_profile(shape, micro_batch_size=2, seq_len=128, precision="bf16", sustained_flops=1e14)
    (cache / "model-bb.json").write_text(json.dumps(model.to_dict()))
    os.utime(cache / "model-bb.json", (now - 90, now - 90))
    (cache / "model-cc.json").write_text(json.dumps({**model.to_dict(), "version": PROFILE_VERSION - 1}))
    (cache / "model-dd.json").write_text("{")
    (cache / "model-ee.1-2.tmp").write_text("")
    rows = report(capsys, "--set", f"profiler.cache_dir={cache}")["Profile cache"]
    assert rows["profile cache"]["text"] == f"{cache}: 4 entries, 1 unfinished *.tmp writes (safe to remove)"
    hardware_text = rows["hardware-aa.json"]["text"]
    assert hardware_text.startswith("2 h 1 min old, ") and hardware_text.endswith(
        "hardware: cuda:NVIDIA H100 80GB HBM3, world size 2, h2d 25.00 GB/s, CPU Adam 1500 M params/s"
    )
    assert rows["model-bb.json"]["text"].startswith("1 min old, ")
    assert (
        f"model: {shape.parameters / 1e6:,.1f} M parameters, 12 blocks, batch 2 x 128, bf16"
        in (rows["model-bb.json"]["text"])
    )
    assert (
        f"(version {PROFILE_VERSION - 1}, this build reads {PROFILE_VERSION}: unused)"
        in (rows["model-cc.json"]["text"])
    )
    assert (
        rows["model-dd.json"]["status"] == "note"
        and "unreadable (JSONDecodeError)" in rows["model-dd.json"]["text"]
    )
    # Newest first; the folder's row lists every entry for the JSON reader.
    assert list(rows)[-2:] == ["model-bb.json", "hardware-aa.json"]
    assert [entry["file"] for entry in rows["profile cache"]["value"]][-1] == "hardware-aa.json"


def test_an_absent_cache_is_not_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = report(capsys, "--set", f"profiler.cache_dir={tmp_path / 'none'}")["Profile cache"]
    assert rows["profile cache"]["text"] == f"{tmp_path / 'none'}: empty (not created yet)"


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_limit_is_the_tightest_of_the_ancestors(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "5:cpu:/\n4:memory:/job/step\n0::/\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", f"{8 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/memory/job/step/memory.limit_in_bytes", "9223372036854771712\n")
    limit, where = cgroup_limit(tmp_path)  # type: ignore[misc]
    assert limit == 8 * GIB and where.endswith("memory/job/memory.limit_in_bytes")
    row = cgroup_row(tmp_path, available=16 * GIB)
    assert row.status is Status.NOTE and "set memory.host_budget under the limit" in row.text
    assert cgroup_row(tmp_path, available=4 * GIB).status is Status.OK


def test_cgroup_v2_unlimited_and_limited(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/user.slice/job\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/job/memory.max", "max\n")
    assert cgroup_row(tmp_path, available=GIB).text.startswith("unlimited")
    write(tmp_path, "sys/fs/cgroup/user.slice/memory.max", f"{2 * GIB}\n")
    assert cgroup_limit(tmp_path) == (2 * GIB, str(tmp_path / "sys/fs/cgroup/user.slice/memory.max"))


def test_no_memory_cgroup_says_so(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "1:cpu:/\n")
    assert cgroup_row(tmp_path, available=GIB).text.startswith("none found")


def test_simd_from_x86_flags_and_arm_features(tmp_path: Path) -> None:
    x86 = simd_row({"sse2", "avx", "avx2", "avx512f", "amx_tile"})
    assert x86.text == "AVX2 yes, AVX-512 yes, AVX-512 BF16 no, AMX no"  # AMX needs amx_bf16 too
    assert simd_row({"fp", "asimd", "sve"}).text == "NEON/ASIMD yes, SVE yes"
    assert simd_row(set()).status is Status.NOTE
    write(tmp_path, "proc/cpuinfo", "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: sse2 avx avx2\n")
    rows = {row.name: row for row in cpu_rows(tmp_path)}
    assert rows["CPU model"].text == "Test CPU 9000" and rows["SIMD"].text.startswith("AVX2 yes, AVX-512 no")


def test_small_helpers() -> None:
    assert cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert sysfs_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert [format_age(s) for s in (42, 420, 3 * 3600 + 300, 3 * 86400 + 7200)] == [
        "42 s",
        "7 min",
        "3 h 5 min",
        "3 d 2 h",
    ]


class NotSupported(Exception):
    """Stands in for pynvml's NVMLError_NotSupported."""


def fake_pynvml(*, init_error: Exception | None = None, link_error: bool = False) -> ModuleType:
    """Two GPUs as NVML would describe them (bytes names, as older pynvml returns them)."""
    module = ModuleType("pynvml")

    def init() -> None:
        if init_error is not None:
            raise init_error

    def link(value: int):  # noqa: ANN202 - a query returning ``value`` or raising
        def query(handle: int) -> int:
            if link_error and handle == 1:
                raise NotSupported("Not Supported")
            return value

        return query

    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    module.nvmlSystemGetDriverVersion = lambda: b"550.54.15"  # type: ignore[attr-defined]
    module.nvmlSystemGetCudaDriverVersion_v2 = lambda: 12040  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda index: index  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda handle: b"NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda handle: type(  # type: ignore[attr-defined]
        "Memory", (), {"total": 80 * GIB, "used": GIB // 2}
    )()
    module.nvmlDeviceGetCudaComputeCapability = lambda handle: (9, 0)  # type: ignore[attr-defined]
    module.nvmlDeviceGetPciInfo = lambda handle: type(  # type: ignore[attr-defined]
        "Pci", (), {"busId": f"00000000:{0x18 + handle:02X}:00.0".encode()}
    )()
    module.nvmlDeviceGetCurrPcieLinkGeneration = link(5)  # type: ignore[attr-defined]
    module.nvmlDeviceGetCurrPcieLinkWidth = link(16)  # type: ignore[attr-defined]
    module.nvmlDeviceGetMaxPcieLinkGeneration = link(5)  # type: ignore[attr-defined]
    module.nvmlDeviceGetMaxPcieLinkWidth = link(16)  # type: ignore[attr-defined]
    return module


def fake_sysfs(root: Path) -> Path:
    for bus, node, width in (("0000:18:00.0", 0, 16), ("0000:19:00.0", 1, 8)):
        write(root, f"{bus}/numa_node", f"{node}\n")
        write(root, f"{bus}/current_link_speed", "16.0 GT/s PCIe\n")
        write(root, f"{bus}/current_link_width", f"{width}\n")
        write(root, f"{bus}/max_link_speed", "32.0 GT/s PCIe\n")
        write(root, f"{bus}/max_link_width", "16\n")
    return root


def test_gpus_through_nvml_with_sysfs_for_what_it_lacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(link_error=True))
    rows = {row.name: row for row in gpu_rows(fake_sysfs(tmp_path))}
    assert rows["NVIDIA driver"].text == "550.54.15"
    assert rows["CUDA driver API"].value == "12.4"
    first, second = rows["GPU 0 (NVML)"], rows["GPU 1 (NVML)"]
    assert first.text == (
        "NVIDIA H100 80GB HBM3, 80.0 GiB (512.0 MiB in use), compute capability 9.0, "
        "PCIe gen 5 x16 (card max gen 5 x16), NUMA node 0, bus 0000:18:00.0"
    )
    assert first.status is Status.OK and first.value["numa_node"] == 0
    # NVML refused the second GPU's link: sysfs gives it, and it runs at half its width.
    assert "PCIe gen 4 x8 (card max gen 5 x16), NUMA node 1" in second.text
    assert "the link runs at x8 of the card's x16" in second.text
    assert "unread: PCIe link: NotSupported: Not Supported" in second.text and second.status is Status.NOTE
    assert "torch.cuda" not in rows and "CUDA devices" not in rows


def test_nvml_failing_at_init_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=NotSupported("Unknown Error")))
    rows = {row.name: row for row in gpu_rows(tmp_path)}
    assert rows["NVML"].status is Status.FAILED and rows["NVML"].text.endswith("NotSupported: Unknown Error")
    assert "CUDA devices" in rows  # torch.cuda's view follows


def test_no_nvidia_driver_is_a_note_not_a_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """pynvml is a dependency, so a machine without an NVIDIA driver is the usual CPU machine."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=NotSupported("Driver Not Loaded")))
    rows = {row.name: row for row in gpu_rows(tmp_path)}
    assert rows["NVML"].status is Status.NOTE and "no NVIDIA driver here" in rows["NVML"].text
    assert "CUDA devices" in rows


def test_a_real_protrain_run_report(tmp_path: Path) -> None:
    """The console script, as a user runs it: exit 0 and the rows a bug report needs; variables
    whose names suggest a secret are named, never shown."""
    env = {**os.environ, "PROTRAIN_REPORT_TEST": "visible-value", "HF_TOKEN": "hunter2-secret"}
    script = Path(sys.executable).with_name("protrain-run")
    done = subprocess.run(
        [str(script), "--report", "--ssd-path", str(tmp_path), "--ssd-probe-size", "256KiB"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for row in ("python", "torch", "CUDA_VISIBLE_DEVICES", "CPU model", "SIMD", "RAM", "cgroup memory limit"):
        assert row in out, row
    for row in ("memory lock limit", "O_DIRECT", "write rate", "read rate", "profile cache"):
        assert row in out, row
    assert "Traceback" not in out + done.stderr
    assert "visible-value" in out and "HF_TOKEN" in out and "hunter2" not in out

"""``protrain-run --report``: the environment report, in-process through the launcher's ``main``
(tables and JSON), its probes on a fake NVML and a fake torch.cuda, the disk probe under
``--ssd-path``, the profile cache, and one real ``protrain-run --report`` process."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import psutil
import pytest
import torch

from protrain.launcher.cli import main
from protrain.runtime.commands.env_report import host
from protrain.runtime.commands.env_report.rows import Status, format_bytes, run_probe
from protrain.runtime.commands.env_report.software import driver_row, git_revision, software_rows, torch_gpu_rows

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, dict[str, dict[str, Any]]]:
    """``protrain-run --report --json ...`` in-process: section title -> row name -> row."""
    assert main(["--report", "--json", *argv]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["protrain_report"] == 2
    return {
        section["title"].split(" (")[0]: {row["name"]: row for row in section["rows"]} for section in body["sections"]
    }


def test_the_report_tells_what_this_machine_is(capsys: pytest.CaptureFixture[str]) -> None:
    sections = report(capsys)
    assert list(sections) == ["Software", "GPUs", "CPU", "Host memory", "SSD", "Profile cache", "Environment variables"]
    software_, gpus, memory = sections["Software"], sections["GPUs"], sections["Host memory"]
    assert software_["python"]["value"] == platform.python_version()
    assert software_["platform"]["text"] == platform.platform()
    assert software_["torch"]["value"] == torch.__version__
    assert software_["pydantic"]["value"] == __import__("pydantic").VERSION
    assert software_["protrain"]["value"]["version"] == "0.1.0"
    if (ROOT / ".git").exists():  # run from the checkout: the commit is named
        assert software_["protrain"]["value"]["git"]
    gloo = torch.distributed.is_available() and torch.distributed.is_gloo_available()
    assert ("gloo" in software_["torch.distributed"]["value"]) == gloo
    if torch.version.cuda is None and torch.version.hip is None:  # this machine: the CPU build, exit 0 all the same
        assert software_["torch build"]["text"] == "CPU-only build (no CUDA)"
        assert gpus["devices"] == {"name": "devices", "text": "none: this torch is a CPU-only build", "value": 0}
    assert sections["CPU"]["cores"]["value"] == {
        "logical": os.cpu_count(),
        "physical": psutil.cpu_count(logical=False),
        "usable": len(os.sched_getaffinity(0)),
    }
    assert memory["RAM"]["value"]["total"] == psutil.virtual_memory().total
    assert 0 < memory["free for the job"]["value"] <= psutil.virtual_memory().total
    assert memory["/dev/shm"]["value"] == shutil.disk_usage("/dev/shm").total
    assert "not measured: give --ssd-path DIR" in sections["SSD"]["SSD path"]["text"]
    assert not [row for section in sections.values() for row in section.values() if row.get("status") == "failed"]


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
    assert rows == {
        "memory": {"name": "memory", "text": "probe failed: RuntimeError: no /proc/meminfo", "status": "failed"}
    }
    assert main(["--report"]) == 0
    assert "1 probe(s) failed" in capsys.readouterr().out
    assert run_probe("x", lambda: [][0])[0].text == "probe failed: IndexError: list index out of range"


def test_the_disk_under_ssd_path_is_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    rows = report(capsys, "--ssd-path", str(tmp_path), "--ssd-probe-size", "1MiB")["SSD"]
    assert time.perf_counter() - started < 10
    usage = shutil.disk_usage(tmp_path)
    assert rows["SSD path"]["text"].startswith(f"{tmp_path.resolve()}; ")
    assert rows["SSD path"]["text"].endswith(f" free of {format_bytes(usage.total)}")
    assert rows["SSD path"]["value"]["total"] == usage.total
    assert isinstance(rows["O_DIRECT"]["value"], bool)
    assert rows["write rate"]["value"] > 0 and rows["read rate"]["value"] > 0
    assert "(1.0 MiB, fsync'd)" in rows["write rate"]["text"]
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_a_missing_ssd_path_is_reported_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
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


def test_the_profile_cache_its_profiles_and_free_space(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    newest = datetime(2024, 5, 1, 12, 30).timestamp()
    for name, written in (("hardware-aa.json", newest - 7300), ("model-bb.json", newest)):
        (cache / name).write_text("{}")
        os.utime(cache / name, (written, written))
    (cache / "model-cc.1-2.tmp").write_text("")  # an unfinished write is no profile
    row = report(capsys, "--set", f"profiler.cache_dir={cache}")["Profile cache"]["profile cache"]
    total = format_bytes(shutil.disk_usage(cache).total)
    assert row["text"].startswith(f"{cache}: 2 profiles, newest 2024-05-01 12:30; ")
    assert row["text"].endswith(f" free of {total}") and row["value"]["path"] == str(cache)
    rows = report(capsys, "--set", f"profiler.cache_dir={tmp_path / 'none'}")["Profile cache"]
    assert rows["profile cache"]["text"] == f"{tmp_path / 'none'}: empty (not created yet)"
    rows = report(capsys, "--set", f"profiler.cache_dir={cache / 'model-bb.json'}")["Profile cache"]
    assert rows["profile cache"]["status"] == "failed" and rows["profile cache"]["text"].endswith("is not a directory")


def test_sizes_read_as_binary_units() -> None:
    assert [format_bytes(n) for n in (512, 1536, 80 * GIB, 3 << 40)] == ["512 B", "1.5 KiB", "80.0 GiB", "3.0 TiB"]


def test_git_revision_names_the_commit_and_local_changes(tmp_path: Path) -> None:
    assert git_revision(tmp_path) is None  # no checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_revision(tmp_path) == head
    (tmp_path / "a.txt").write_text("2")
    assert git_revision(tmp_path) == f"{head}-dirty"


def test_torch_build_names_rocm_and_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2.4")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    rows = {row.name: row for row in software_rows()}
    assert rows["torch build"].text == "ROCm (HIP 6.2.4)" and rows["torch build"].value == "6.2.4"
    assert rows["torch.distributed"].text.startswith("nccl") and rows["torch.distributed"].text.endswith(
        " (NCCL 2.21.5)"
    )


class NotSupported(Exception):
    """Stands in for pynvml's NVMLError_NotSupported."""


def fake_pynvml(init_error: Exception | None = None) -> ModuleType:
    """NVML as a driver 550 serving CUDA 12.4 describes itself (bytes, as older pynvml returns)."""
    module = ModuleType("pynvml")

    def init() -> None:
        if init_error is not None:
            raise init_error

    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    module.nvmlSystemGetDriverVersion = lambda: b"550.54.15"  # type: ignore[attr-defined]
    module.nvmlSystemGetCudaDriverVersion = lambda: 12040  # type: ignore[attr-defined]
    return module


def test_the_driver_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    row = driver_row()
    assert (row.text, row.value, row.status) == ("550.54.15 (CUDA 12.4)", "550.54.15", Status.OK)


def test_no_nvidia_driver_is_a_note_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """pynvml is a dependency, so a machine without an NVIDIA driver is the usual CPU machine."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(NotSupported("Driver Not Loaded")))
    row = driver_row()
    assert row.status is Status.NOTE and row.text == "none found (NotSupported: Driver Not Loaded)"


def test_each_gpu_torch_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPUs through a fake torch.cuda: NVML knows what the first holds, not the second."""
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB, major=9, minor=0)

    def used(index: int) -> int:
        if index == 1:
            raise RuntimeError("NVML not available")
        return GIB // 2

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "device_memory_used", used)
    rows = {row.name: row for row in torch_gpu_rows()}
    assert rows["devices"].value == 2
    assert rows["cuda:0"].text == "NVIDIA H100 80GB HBM3, 80.0 GiB (512.0 MiB in use), compute capability 9.0"
    assert rows["cuda:0"].value == {
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total": 80 * GIB,
        "memory_used": GIB // 2,
        "capability": "9.0",
    }
    assert rows["cuda:1"].text == "NVIDIA H100 80GB HBM3, 80.0 GiB, compute capability 9.0"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert torch_gpu_rows()[0].status is Status.NOTE and "none visible" in torch_gpu_rows()[0].text


def test_small_shm_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Docker's default 64 MiB /dev/shm: NCCL and DataLoader workers fail with "Bus error"."""
    monkeypatch.setattr(host.shutil, "disk_usage", lambda path: SimpleNamespace(total=64 << 20, free=60 << 20))
    (row,) = host.shm_rows()
    assert row.status is Status.NOTE and row.text.startswith("64.0 MiB total; small for NCCL")


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
    for row in ("python", "torch build", "NVIDIA driver", "devices", "cores", "RAM", "free for the job", "/dev/shm"):
        assert row in out, row
    for row in ("O_DIRECT", "write rate", "read rate", "profile cache"):
        assert row in out, row
    assert "Traceback" not in out + done.stderr
    assert "visible-value" in out and "HF_TOKEN" in out and "hunter2" not in out

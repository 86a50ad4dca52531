"""Host memory as a user's machine has it (runtime/hw/host_capacity.py): the auto host budget is the
smallest of available RAM, a cgroup's headroom (Docker, Kubernetes, Slurm's cgroups) and Slurm's
allocation, shared among the node's ranks; the plan's host figure counts what the process holds
at start and an asynchronous save's staging, and a plan that does not fit is refused before
training with the numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest

import protrain.runtime.entry  # noqa: F401 - imported before the readings: initialize's imports are not the test's
from protrain import runtime
from protrain.profiler.host_bytes import checkpoint_staging_bytes
from protrain.runtime.commands.env_report.host import free_row
from protrain.runtime.config.spec_io import SpecError
from protrain.runtime.hw.host_capacity import HostSource, cgroup_headroom, free_host_bytes, host_sources, slurm_source
from protrain.runtime.planning import budgets
from tests.helpers import lm_batches, tiny_gpt

GIB = 1 << 30
SLACK = 32 << 20
"""The process's resident set moves a little between a reading here and initialize's own."""


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_kubernetes_v2_the_pods_limit_less_its_usage_binds_though_the_process_group_is_max(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/container\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/container/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/container/memory.current", f"{3 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/memory.max", f"{8 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/pod1/memory.current", f"{5 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/memory.max", f"{64 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/kubepods/memory.current", f"{10 * GIB}\n")
    headroom, limit, where = cgroup_headroom(tmp_path)  # type: ignore[misc]
    assert (headroom, limit) == (3 * GIB, 8 * GIB) and where.endswith("pod1/memory.max")


def test_v1_no_limit_is_a_rounded_two_to_the_63_and_limits_count_their_usage(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "4:memory:/job\n")
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", "9223372036854771712\n")
    assert cgroup_headroom(tmp_path) == (None, None, f"memory.limit_in_bytes under {tmp_path / 'sys/fs/cgroup/memory'}")
    write(tmp_path, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", f"{4 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/memory/job/memory.usage_in_bytes", f"{GIB}\n")
    assert cgroup_headroom(tmp_path)[:2] == (3 * GIB, 4 * GIB)  # type: ignore[index]


def test_slurm_mem_per_node_or_per_cpu_times_cpus_less_what_the_ranks_hold() -> None:
    # The resident set is read here and again inside: a thread left by an earlier test of the
    # same worker may touch a page between the two readings.
    moves = 1 << 20
    rss = psutil.Process().memory_info().rss
    node = slurm_source({"SLURM_MEM_PER_NODE": "16384"}, ranks_on_host=2)
    assert node.free_bytes is not None and "SLURM_MEM_PER_NODE" in node.detail
    assert abs(node.free_bytes - (16 * GIB - 2 * rss)) < 2 * moves
    per_cpu = slurm_source({"SLURM_MEM_PER_CPU": "2048", "SLURM_CPUS_ON_NODE": "4"}, ranks_on_host=1)
    assert per_cpu.free_bytes is not None and "SLURM_CPUS_ON_NODE (4)" in per_cpu.detail
    assert abs(per_cpu.free_bytes - (8 * GIB - rss)) < moves
    assert slurm_source({}, ranks_on_host=1).free_bytes is None


def test_the_budget_takes_the_tightest_source_and_shares_it_among_the_ranks(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/job\n")
    write(tmp_path, "sys/fs/cgroup/job/memory.max", f"{6 * GIB}\n")
    write(tmp_path, "sys/fs/cgroup/job/memory.current", f"{2 * GIB}\n")
    free, source = free_host_bytes(root=tmp_path, env={}, ranks_on_host=1)
    names = [s.name for s in host_sources(root=tmp_path, env={})]
    assert names == ["available RAM", "cgroup", "Slurm"]
    assert (free, source.name) == (min(4 * GIB, psutil.virtual_memory().available), source.name)
    rss = budgets.process_rss_bytes()
    share = budgets.auto_host_budget(ranks_on_host=4, free_bytes=lambda: 10 * GIB)
    assert abs(share - ((10 * GIB - budgets.HOST_RESERVE_BYTES) // 4 + rss)) < 64 << 20  # RSS moves a little


def test_the_report_and_the_budget_read_one_function(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/job\n")
    write(tmp_path, "sys/fs/cgroup/job/memory.max", f"{GIB}\n")
    write(tmp_path, "sys/fs/cgroup/job/memory.current", f"{GIB // 4}\n")
    row = free_row(tmp_path)
    assert row.value == free_host_bytes(root=tmp_path)[0]
    assert "the tightest: cgroup" in row.text


def job(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "micro_batch_size": 2,
        "output_dir": str(tmp_path / "runs"),
        "profiler": {"cache_dir": str(tmp_path / "cache")},
        **extra,
    }


def test_the_plans_host_figure_counts_the_process_at_start_and_an_async_saves_staging(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    before = budgets.process_rss_bytes()
    with runtime.initialize(tiny_gpt(), config=job(tmp_path), example_batch=data.batch(0, 0, 0)) as plain:
        fixed = plain.plan.host_fixed_bytes
        assert abs(fixed - before) < SLACK, "what the process held when initialize began"
        assert plain.plan.predicted_peak_host_bytes >= fixed
    sizes = [(p.numel(), True) for p in tiny_gpt().parameters() if p is not tiny_gpt().lm_head.weight]
    staging = checkpoint_staging_bytes(sizes, element_size=4, world_size=1)
    config = job(tmp_path, checkpoint={"dir": str(tmp_path / "ckpt"), "async_save": True})
    before = budgets.process_rss_bytes()
    with runtime.initialize(tiny_gpt(), config=config, example_batch=data.batch(0, 0, 0)) as saving:
        assert abs(saving.plan.host_fixed_bytes - (before + staging)) < SLACK


def test_a_host_budget_the_process_alone_passes_is_refused_before_training_with_the_numbers(tmp_path: Path) -> None:
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=1)
    budget = budgets.process_rss_bytes() // 2  # less than the interpreter and torch already hold
    config = job(tmp_path, memory={"host_budget": budget, "device_budget": "1MiB", "chunk_size": "64KiB"})
    with pytest.raises(SpecError) as refused:
        runtime.initialize(tiny_gpt(), config=config, example_batch=data.batch(0, 0, 0))
    text = str(refused.value)
    assert "host budget" in text or "memory.host_budget" in text, text
    assert "the process" in text and "at start" in text, text

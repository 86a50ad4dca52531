"""protrain-run as a user runs it: real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.conftest import ROOT, Job, clean_env, pid_alive, wait_for


def test_two_ranks_train_lm_demo_script(job: Job) -> None:
    result = job.run(
        "--nproc-per-node",
        "2",
        str(ROOT / "scripts" / "train_lm.py"),
        "--preset",
        "tiny",
        "--steps",
        "3",
        "--config",
        str(job.spec),
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert "ProTrain plan" in result.stdout and "step 3/3" in result.stdout
    (metrics,) = (job.workdir / "runs").glob("*/metrics.jsonl")
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"step"' in line]
    assert [s["step"] for s in steps] == [1, 2, 3]
    (spec_file,) = (job.workdir / "runs").glob("*/spec.json")
    resolved = json.loads(spec_file.read_text())
    assert resolved["spec"]["launcher"]["nproc_per_node"] == 2 and "memory.n_persist" in resolved["auto"]


def test_failing_rank_ends_the_job_and_the_other_rank(job: Job) -> None:
    result = job.run("--nproc-per-node", "2", str(job.script), "fail", "--config", str(job.spec), timeout=120)
    assert result.returncode == 1
    assert "rank one fails on purpose" in result.stderr
    assert "protrain-run: rank 1 failed with exit code 1: RuntimeError: rank one fails on purpose" in result.stderr
    assert "rank 0 failed" not in result.stderr, "the rank stopped after the failure is not the cause"
    survivor = int((job.workdir / "rank0.pid").read_text())
    wait_for(lambda: not pid_alive(survivor), 10, "rank 0 to end")


def test_sigint_ends_every_rank_with_130(job: Job) -> None:
    proc = job.start("--nproc-per-node", "2", str(job.script), "forever", "--config", str(job.spec))
    try:
        wait_for(lambda: all((job.workdir / f"rank{r}.ready").exists() for r in range(2)), 90, "ranks to train")
        pids = [int((job.workdir / f"rank{r}.pid").read_text()) for r in range(2)]
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    for pid in pids:
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"rank pid {pid} to end")


@pytest.mark.parametrize("delay_s", [0.3, 1.0, 1.7, 2.2, 3.0], ids=lambda d: f"after-{d}s")
def test_ctrl_c_during_startup_exits_130_quietly(job: Job, delay_s: float) -> None:
    """A terminal's Ctrl-C reaches the launcher's whole process group, at any moment."""
    proc = subprocess.Popen(
        job.command("--nproc-per-node", "2", str(job.script), "forever", "--config", str(job.spec)),
        cwd=job.workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        start_new_session=True,
    )
    try:
        time.sleep(delay_s)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    for pid_file in job.workdir.glob("rank*.pid"):
        pid = int(pid_file.read_text())
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"rank pid {pid} to end")


def test_ranks_die_with_a_killed_launcher(job: Job) -> None:
    proc = job.start("--nproc-per-node", "2", str(job.script), "forever", "--config", str(job.spec))
    try:
        wait_for(lambda: all((job.workdir / f"rank{r}.ready").exists() for r in range(2)), 90, "ranks to train")
        pids = [int((job.workdir / f"rank{r}.pid").read_text()) for r in range(2)]
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    for pid in pids:
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"orphaned rank {pid} to end")


def test_dry_run_one_child_no_group_no_files(job: Job) -> None:
    probe = job.workdir / "probe.py"
    probe.write_text(
        "import os, torch.distributed as dist\n"
        "print('CHILD', os.getppid(), 'RANK' in os.environ, flush=True)\n" + job.script.read_text()
    )
    before = sorted(str(p.relative_to(job.workdir)) for p in job.workdir.rglob("*"))
    proc = job.start("--nproc-per-node", "2", "--dry-run", str(probe), "--config", str(job.spec))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    children = [line.split() for line in stdout.splitlines() if line.startswith("CHILD")]
    assert children == [["CHILD", str(proc.pid), "False"]]
    assert "Plan for 2 rank(s)" in stdout and "dry run: no process group, no training step" in stdout
    # The script gives no example batch: the plan shown is where the run starts.
    assert "profiles a batch through the chunk engine" in " ".join(stdout.split())
    assert sorted(str(p.relative_to(job.workdir)) for p in job.workdir.rglob("*")) == before


def test_knobs_no_plan_can_honour_end_the_job_with_exit_2_and_one_message(job: Job) -> None:
    """Found inside the ranks (only they see the model): each rank stops on the same SpecError,
    and protrain-run prints its message once, with no traceback from any rank."""
    knobs = ["--set", "memory.n_persist=0", "--set", "memory.n_buffer=0", "--set", "memory.chunk_size=64KiB"]
    result = job.run("--nproc-per-node", "2", str(job.script), "--config", str(job.spec), *knobs, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stderr.count("protrain-run: error: memory.n_buffer=0 is too few") == 1, result.stderr
    assert "the smallest n_buffer that works is 2" in result.stderr
    assert "failed with exit code" not in result.stderr


@pytest.mark.parametrize(
    ("spec_text", "needle"),
    [
        ("memory: {n_persistent: 1}\n", "memory.n_persistent: unknown key"),
        ("seed: [1,\n", "YAML syntax error"),
        (None, "no such file"),
    ],
    ids=["unknown-key", "syntax", "missing-file"],
)
def test_bad_input_as_a_real_process(job: Job, spec_text: str | None, needle: str) -> None:
    config = job.workdir / "bad.yaml"
    if spec_text is not None:
        config.write_text(spec_text)
    result = job.run(str(job.script), "--config", str(config), timeout=60)
    assert result.returncode == 2
    assert needle in result.stderr and str(config) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (job.workdir / "runs").exists(), "no rank may start on bad input"

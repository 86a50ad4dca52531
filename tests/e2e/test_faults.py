"""Faults through protrain-run, with real processes and real signals: a rank killed with
SIGKILL is restarted by torch's elastic agent and the job resumes from its last checkpoint to the
same parameters as an uninterrupted run; Ctrl-C saves a checkpoint on every rank and exits 130;
a second Ctrl-C aborts at once and the previous checkpoint stays the latest."""

from __future__ import annotations

import signal
import subprocess
import time

import torch

from tests.e2e.conftest import Job, pid_alive, wait_for
from tests.helpers import assert_state_equal

SCRIPT = """\
import os, signal, sys, time
from pathlib import Path
import torch
from protrain import runtime
from protrain_demo.corpus import TokenWindows, stdlib_text_corpus
from protrain_demo.gpt import GPT, PRESETS

mode, until = sys.argv[1], int(sys.argv[2])
spec = runtime.current_spec()
torch.manual_seed(spec.seed)
engine = runtime.initialize(GPT(PRESETS["tiny"]))
rank = engine.rank
Path(f"rank{rank}.pid").write_text(str(os.getpid()))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
with engine:
    loader = engine.data_loader(TokenWindows(stdlib_text_corpus()[: 400 * 33], 32))
    while engine.global_step < until:
        for batch in loader:
            out = engine(**batch)
            if mode == "kill" and first_attempt and rank == 1 and engine.global_step == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step, one rank only
            engine.backward(out.loss)
            engine.step()
            if mode == "slow" and engine.global_step >= 2:
                Path(f"rank{rank}.ready").write_text("1")
                time.sleep(float(sys.argv[3]))
            if engine.global_step >= until:
                break
    state = engine.state_dict()  # every rank takes part in the gathers
    if rank == 0:
        torch.save(state, sys.argv[3] if mode != "slow" else "final.pt")
"""

# Hand-set knobs: the two launches compared must run the same plan (a searched one follows timings).
SETS = [
    "--set", "memory.chunk_size=256KiB", "--set", "memory.n_persist=1", "--set", "memory.n_buffer=2",
    "--set", "checkpoint.dir=ckpt", "--set", "checkpoint.interval_steps=2",
]  # fmt: skip


def launch(
    job: Job,
    launcher_args: list[str],
    script_args: list[str],
    sets: list[str] = (),  # type: ignore[assignment]
) -> subprocess.CompletedProcess[str]:
    script = job.workdir / "faults.py"
    script.write_text(SCRIPT)
    return job.run(
        "--nproc-per-node", "2", *launcher_args, str(script), *script_args, "--config", str(job.spec),
        *SETS, *sets, timeout=180,
    )  # fmt: skip


def test_a_killed_rank_is_restarted_and_the_job_resumes_to_the_same_parameters(job: Job) -> None:
    full = launch(job, [], ["train", "6", "full.pt"], ["--set", "checkpoint.dir=full-ckpt"])
    assert full.returncode == 0, full.stderr
    killed = launch(job, ["--max-restarts", "1"], ["kill", "6", "resumed.pt"])
    assert killed.returncode == 0, killed.stderr
    assert "resumed from ckpt/step-00000002 (update 2)" in killed.stdout
    assert_state_equal(torch.load(job.workdir / "resumed.pt"), torch.load(job.workdir / "full.pt"))
    assert "Warning" not in killed.stderr, killed.stderr


def start_slow(job: Job, pause_s: float) -> tuple[subprocess.Popen[str], list[int]]:
    script = job.workdir / "faults.py"
    script.write_text(SCRIPT)
    proc = job.start(
        "--nproc-per-node", "2", str(script), "slow", "100", str(pause_s), "--config", str(job.spec), *SETS
    )  # fmt: skip
    wait_for(lambda: all((job.workdir / f"rank{r}.ready").exists() for r in range(2)), 120, "ranks to train")
    return proc, [int((job.workdir / f"rank{r}.pid").read_text()) for r in range(2)]


def test_ctrl_c_checkpoints_every_rank_and_exits_130(job: Job) -> None:
    proc, pids = start_slow(job, 0.05)
    try:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    root = job.workdir / "ckpt"
    latest = (root / "latest").read_text().strip()
    step = int(latest.split("-")[1])
    # The stop's own checkpoint, of the update every rank finished when the stop was agreed.
    assert step >= 2 and f"stopped at update {step}; checkpoint ckpt/{latest}" in stdout
    assert sorted(p.name for p in (root / latest).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]
    for pid in pids:
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"rank pid {pid} to end")


def test_a_second_ctrl_c_aborts_at_once_keeping_the_last_checkpoint(job: Job) -> None:
    proc, pids = start_slow(job, 60.0)  # each rank sits 60 s after update 2: a stop would wait
    try:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert time.monotonic() - started < 10 and "protrain-run: aborted" in stderr
    for pid in pids:
        wait_for(lambda pid=pid: not pid_alive(pid), 10, f"rank pid {pid} to end")
    assert (job.workdir / "ckpt" / "latest").read_text() == "step-00000002\n"

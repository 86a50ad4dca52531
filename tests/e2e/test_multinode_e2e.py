"""Several nodes as a user starts them, on loopback: as Slurm's tasks (one per rank, told only
what ``srun`` tells them) and from a hostfile (this machine as two hosts, the second reached
through a fake ``ssh``, then a fake ``pdsh``, on PATH, since there is no ssh server here, that
record their arguments and run the command locally, as real ones run it on the remote host).
Each trains exactly as one node running both ranks, loss for loss. (How a remote node stops:
test_remote_stop_e2e.py.)"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
from pathlib import Path

from protrain.launcher.slurm import PORT_BASE, PORT_SPAN
from tests.e2e.conftest import Job
from tests.unit.test_hostfile import FAKE_PDSH

FAKE_SSH = """#!/bin/bash
# ssh [-o OPTION]... HOST COMMAND: record the arguments, run COMMAND here with ssh's stdin, in its
# own session as on another machine (a signal to ssh does not reach it).
printf '%s\\n' "$@" >> "$FAKE_SSH_LOG"
while [[ "$1" == -* ]]; do if [[ "$1" == "-o" ]]; then shift 2; else shift; fi; done
shift  # the host
exec setsid -w bash -c "$*"
"""


def test_nodes_by_slurm_and_by_hostfile_train_as_one_node(job: Job, tmp_path: Path) -> None:
    """Each hostfile node is started by hand's flags (``--nnodes 2 --node-rank R --master-addr``),
    so the hostfile launches test nodes started by hand too."""
    one_node = job.run("--nproc-per-node", "2", str(job.script), "--config", str(job.spec), timeout=150)
    assert one_node.returncode == 0, one_node.stderr
    expected = [(job.workdir / f"rank{r}.loss").read_text() for r in range(2)]
    train = [str(job.script), "--config", str(job.spec)]

    def trains_as_one_node(started: list[subprocess.Popen[str]], how: str) -> None:
        try:
            outputs = [proc.communicate(timeout=150) for proc in started]
        finally:
            for proc in started:
                proc.kill()
        for proc, (_, stderr) in zip(started, outputs, strict=True):
            assert proc.returncode == 0, (how, stderr)
        assert sorted((job.workdir / f"rank{r}.done").read_text() for r in range(2)) == ["0 2 3", "1 2 3"], how
        assert [(job.workdir / f"rank{r}.loss").read_text() for r in range(2)] == expected, how
        for done in job.workdir.glob("rank*.*"):
            done.unlink()

    for stale in job.workdir.glob("rank*.*"):
        stale.unlink()
    # Slurm, one task per rank on one node: the rendezvous counts tasks, the port comes from
    # the job id; each rank's LOCAL_RANK is its task's SLURM_LOCALID.
    port = free_port_in(PORT_BASE, PORT_BASE + PORT_SPAN)
    slurm = {
        "SLURM_JOB_ID": str(port - PORT_BASE),
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "2",
    }
    tasks = [{**slurm, "SLURM_PROCID": str(t), "SLURM_LOCALID": str(t)} for t in range(2)]
    trains_as_one_node([job.start(*train, env=task) for task in tasks], "slurm")

    # A hostfile: 127.0.0.2 is this machine too, but not a name of it, so it goes through ssh.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "ssh.log"
    (job.workdir / ".protrain_env").write_text("PROTRAIN_FORWARDED_MARK=from-the-env-file\n")
    (job.workdir / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    port = free_port()
    head = job.start(
        "--hostfile", "hostfile", "--remote", "ssh", "--master-port", str(port), *train,
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SSH_LOG": str(log)},
    )  # fmt: skip
    trains_as_one_node([head], "hostfile")
    ssh_args = log.read_text().splitlines()
    assert ssh_args[:3] == ["-o", "BatchMode=yes", "127.0.0.2"], ssh_args  # one remote host, once
    remote = ssh_args[3]
    assert remote.startswith(f"cd {job.workdir} && env ") and "PROTRAIN_FORWARDED_MARK=from-the-env-file" in remote
    assert "--node-rank 1 --master-addr 127.0.0.1" in remote and "--hostfile" not in remote

    # pdsh on PATH (and no --remote): one pdsh starts the remote host, which finds its node rank
    # from the name pdsh puts for %h.
    pdsh_dir = tmp_path / "pdsh-bin"
    pdsh_dir.mkdir()
    (pdsh_dir / "pdsh").write_text(FAKE_PDSH)
    (pdsh_dir / "pdsh").chmod(0o755)
    pdsh_log = tmp_path / "pdsh.log"
    head = job.start(
        "--hostfile", "hostfile", "--master-port", str(free_port()), *train,
        env={"PATH": f"{pdsh_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_PDSH_LOG": str(pdsh_log)},
    )  # fmt: skip
    trains_as_one_node([head], "hostfile through pdsh")
    (record,) = [json.loads(line) for line in pdsh_log.read_text().splitlines()]
    assert record["rcmd"] == "ssh" and record["argv"][:5] == ["-S", "-f", "1024", "-w", "127.0.0.2"], record
    remote = record["argv"][5]
    assert "PROTRAIN_FORWARDED_MARK=from-the-env-file" in remote and "--hostfile" not in remote
    assert "--stop-on-stdin-eof --node-rank-of %h --node-hosts 127.0.0.1,127.0.0.2 --nnodes 2" in remote


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_in(low: int, high: int) -> int:
    """A port free now in [low, high), starting from a place that differs between processes."""
    for offset in range(high - low):
        port = low + (os.getpid() * 7919 + offset) % (high - low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")

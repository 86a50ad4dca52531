"""Several nodes as a user starts them, on loopback: by hand (``--nnodes``/``--node-rank``), as
Slurm's tasks (one per rank, told only what ``srun`` tells them) and from a hostfile (this
machine as two hosts, the second reached through a fake ``ssh``, then a fake ``pdsh``, on PATH,
since there is no ssh server here, that record their arguments and run the command locally, as
real ones run it on the remote host). Each trains exactly as one node running both ranks, loss
for loss. And a remote node stops its ranks when the head closes its input."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from protrain.launcher.hostfile import Node
from protrain.launcher.multinode import STOP_GRACE_S, NodeLaunch, node_launches, run_nodes
from protrain.launcher.slurm import PORT_BASE, PORT_SPAN
from tests.e2e.conftest import Job, clean_env, pid_alive, wait_for
from tests.unit.test_hostfile import FAKE_PDSH, put_on_path

FAKE_SSH = """#!/bin/bash
# ssh [-o OPTION]... HOST COMMAND: record the arguments, run COMMAND here with ssh's stdin, in its
# own session as on another machine (a signal to ssh does not reach it).
printf '%s\\n' "$@" >> "$FAKE_SSH_LOG"
while [[ "$1" == -* ]]; do if [[ "$1" == "-o" ]]; then shift 2; else shift; fi; done
shift  # the host
exec setsid -w bash -c "$*"
"""


def test_nodes_by_hand_by_slurm_and_by_hostfile_train_as_one_node(job: Job, tmp_path: Path) -> None:
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
    # By hand: two nodes of one rank each.
    port = free_port()
    by_hand = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    trains_as_one_node([job.start(*by_hand, "--node-rank", str(r), *train) for r in range(2)], "by hand")

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


def test_a_remote_node_stops_its_ranks_when_the_head_closes_its_input(
    job: Job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local node fails while a remote node (through the fake ssh, out of reach of the head's
    signals as on another machine) would train forever: the head closes the remote node's stdin,
    and its protrain-run stops its rank and exits within seconds, leaving no process behind."""
    put_on_path(monkeypatch, tmp_path / "bin", "ssh", FAKE_SSH)
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    remote = node_launches(
        [Node("127.0.0.2", (0,))], hosts={"127.0.0.2": 1}, master_port=free_port(),
        rest=[str(job.script), "forever", "--config", str(job.spec)], cwd=job.workdir,
        env={"PYTHONPATH": clean_env()["PYTHONPATH"]}, remote="ssh",
    )  # fmt: skip
    # Fails once the remote rank trains, after noting it and its launcher (the rank's parent).
    note = "pid=$(cat rank0.pid); echo $pid $(ps -o ppid= -p $pid) > pids"
    local = NodeLaunch(["bash", "-c", f"until [ -e rank0.ready ]; do sleep 0.1; done; {note}; touch failed; exit 3"])
    pids: list[int] = []
    try:
        assert run_nodes([local, *remote], cwd=job.workdir) == 3
        pids = [int(word) for word in (job.workdir / "pids").read_text().split()]
        failed_at = (job.workdir / "failed").stat().st_mtime
        wait_for(lambda: not any(map(pid_alive, pids)), timeout=10, what="the remote rank and launcher to end")
        # By its input's end (took about 1 s), not the head's SIGKILL of ssh after the grace, which
        # closes the input too.
        assert time.time() - failed_at < STOP_GRACE_S - 5
        assert processes_in(job.workdir) == []
    finally:
        for pid in [*pids, *processes_in(job.workdir)]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def processes_in(folder: Path) -> list[int]:
    """The processes whose working directory is ``folder`` (a job's own, left running)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if Path(os.readlink(entry / "cwd")) == folder and pid_alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return found

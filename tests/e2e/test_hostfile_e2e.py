"""protrain-run --hostfile on loopback: this machine as two hosts, the second reached through a
fake ``ssh`` on PATH (no ssh server here) that records its arguments and runs the command
locally, as a real one runs it on the remote host."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from tests.e2e.conftest import Job

FAKE_SSH = """#!/bin/bash
# ssh [-o OPTION]... HOST COMMAND: record the arguments, run COMMAND here.
printf '%s\\n' "$@" >> "$FAKE_SSH_LOG"
while [[ "$1" == -* ]]; do if [[ "$1" == "-o" ]]; then shift 2; else shift; fi; done
shift  # the host
exec bash -c "$*"
"""


def test_a_hostfile_job_over_ssh_trains_as_one_node_with_two_ranks(job: Job, tmp_path: Path) -> None:
    one_node = job.run("--nproc-per-node", "2", str(job.script), "--config", str(job.spec), timeout=150)
    assert one_node.returncode == 0, one_node.stderr
    expected = [(job.workdir / f"rank{r}.loss").read_text() for r in range(2)]
    for stale in job.workdir.glob("rank*.*"):
        stale.unlink()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "ssh.log"
    (job.workdir / ".protrain_env").write_text("PROTRAIN_FORWARDED_MARK=from-the-env-file\n")
    # 127.0.0.2 is this machine too, but not a name of it: the launcher goes through ssh.
    (job.workdir / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    head = job.start(
        "--hostfile", "hostfile", "--master-port", port, str(job.script), "--config", str(job.spec),
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SSH_LOG": str(log)},
    )  # fmt: skip
    try:
        _, stderr = head.communicate(timeout=150)
    finally:
        head.kill()
    assert head.returncode == 0, stderr
    assert sorted((job.workdir / f"rank{r}.done").read_text() for r in range(2)) == ["0 2 3", "1 2 3"]
    assert [(job.workdir / f"rank{r}.loss").read_text() for r in range(2)] == expected
    ssh_args = log.read_text().splitlines()
    assert ssh_args[:3] == ["-o", "BatchMode=yes", "127.0.0.2"], ssh_args  # one remote host, once
    remote = ssh_args[3]
    assert remote.startswith(f"cd {job.workdir} && env ") and "PROTRAIN_FORWARDED_MARK=from-the-env-file" in remote
    assert "--node-rank 1 --master-addr 127.0.0.1" in remote and "--hostfile" not in remote

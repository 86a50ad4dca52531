"""A remote node of a hostfile job stops its ranks when the head closes its input (ssh forwards
no signal without a tty), here reached through a fake ``ssh`` on PATH that runs the command in a
session of its own, out of reach of the head's signals as on another machine."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from protrain.launcher.hostfile import Node
from protrain.launcher.multinode import STOP_GRACE_S, NodeLaunch, node_launches, run_nodes
from tests.e2e.conftest import Job, clean_env, pid_alive, wait_for
from tests.e2e.test_multinode_e2e import FAKE_SSH, free_port
from tests.unit.test_hostfile import put_on_path


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

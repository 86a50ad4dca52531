"""``protrain-run --hostfile FILE``: one ``protrain-run`` per host of the hostfile, this machine's
started directly, the others over ``pdsh`` when it is on PATH (one pdsh for all hosts of one
shape), else over ``ssh``, one per host (``--remote ssh|pdsh`` picks); each told the job's node
count, its node rank and the first host as the master. The head waits for every node: the first
to fail ends the others, and its exit code is the job's; Ctrl-C reaches every node (a second one
kills them).

A remote node runs ``cd <this directory> && env <forwarded variables> <this python> -m
protrain.launcher --stop-on-stdin-eof ...``: the same paths, Python environment and spec must exist
there (a shared file system), as with DeepSpeed's launcher.

Stopping a remote node early: ssh without a tty forwards no signal, so the head holds each ssh's
stdin open for the job's life and closes it when the job ends early (a node failed, Ctrl-C, or the
head itself died). ssh passes the end of input on, and the remote protrain-run, which watches its
stdin (``remote_node.py``), stops its ranks as on Ctrl-C; ssh still relays its output and exit
code. pdsh passes no stdin on, but holds that of each of its ssh connections: the head ends pdsh,
which closes them, so its nodes stop the same way, though their output from then on is lost and
the head does not wait for them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from protrain.launcher.hostfile import HostfileError, Node, is_this_host
from protrain.launcher.remote_node import NODE_HOSTS, NODE_RANK_OF, STOP_ON_STDIN_EOF
from protrain.launcher.request import EXIT_INTERRUPTED, EXIT_OK

DEFAULT_MASTER_PORT = 29500
"""torchrun's: the first host's rendezvous port unless launcher.master_port is set (the head cannot
ask a remote host for a free one)."""
POLL_S = 0.2
STOP_GRACE_S = 15.0
"""How long nodes get to end after the first failure (or a Ctrl-C) before they are killed."""
REMOTE_CHOICES = ("auto", "ssh", "pdsh")
"""``--remote``: auto is pdsh when it is on PATH, else ssh."""
PDSH_FANOUT = "1024"
"""DeepSpeed's: every host at once (pdsh's default, 32, would start a large job in waves)."""
_PDSH_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A name pdsh's -w takes as it is (no range, list, user@, regex or exclusion)."""
_HOST_MARK = "@@protrain-pdsh-host@@"
"""Stands for pdsh's %h while the remote command is quoted and its own % signs escaped (shlex
leaves it as it is)."""

Via = Literal["local", "ssh", "pdsh"]


@dataclass(frozen=True, slots=True)
class NodeLaunch:
    """One process the head starts and supervises: a node on this machine, one ssh (one remote
    node) or one pdsh (the remote nodes of one shape)."""

    argv: list[str]
    env: dict[str, str] | None = None
    """None: the head's own environment."""
    via: Via = "local"
    """How it is stopped early: a signal (local), or the end of its stdin (ssh, pdsh)."""


def node_arguments(nodes: list[Node], index: int, *, master_port: int, rest: list[str]) -> list[str]:
    """protrain-run's arguments for node ``index``: the job's shape, then the user's own."""
    return [
        "--nnodes",
        str(len(nodes)),
        "--node-rank",
        str(index),
        "--master-addr",
        nodes[0].host,
        "--master-port",
        str(master_port),
        "--nproc-per-node",
        str(len(nodes[index].slots)),
        *rest,
    ]


def node_variables(node: Node, env: dict[str, str], *, total_slots: int) -> dict[str, str]:
    """The forwarded variables, and the node's ``CUDA_VISIBLE_DEVICES`` when it runs on a subset
    of its slots."""
    variables = dict(env)
    if len(node.slots) != total_slots or list(node.slots) != list(range(len(node.slots))):
        variables["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, node.slots))
    return variables


def remote_command(cwd: Path, variables: dict[str, str], arguments: list[str]) -> str:
    """The shell command a remote host runs: this directory, these variables, this Python."""
    assignments = [f"{name}={shlex.quote(value)}" for name, value in sorted(variables.items())]
    launcher = [sys.executable, "-m", "protrain.launcher", STOP_ON_STDIN_EOF, *arguments]
    return f"cd {shlex.quote(str(cwd))} && env {' '.join(assignments)} {shlex.join(launcher)}"


def remote_via(choice: str, nodes: list[Node]) -> Via:
    """ssh or pdsh for the remote hosts (``--remote``; auto: pdsh when it is on PATH and takes
    every host name as it is)."""
    if choice == "ssh":
        return "ssh"
    plain = all(_PDSH_HOST.fullmatch(node.host) for node in nodes)
    if choice == "pdsh":
        if shutil.which("pdsh") is None:
            raise HostfileError("--remote pdsh: pdsh is not on PATH; install it or give --remote ssh")
        if not plain:
            odd = next(node.host for node in nodes if not _PDSH_HOST.fullmatch(node.host))
            raise HostfileError(f"--remote pdsh: pdsh's -w would not take the host {odd!r} as it is; give --remote ssh")
        return "pdsh"
    return "pdsh" if plain and shutil.which("pdsh") is not None else "ssh"


def node_launches(
    nodes: list[Node],
    *,
    hosts: dict[str, int],
    master_port: int,
    rest: list[str],
    cwd: Path,
    env: dict[str, str],
    remote: str = "auto",
) -> list[NodeLaunch]:
    """What starts each node: this machine's directly, the others by one ssh each, or by one pdsh
    per shape: a pdsh command is the same for all its hosts, so hosts whose ranks per node or
    CUDA_VISIBLE_DEVICES differ need one each."""
    via = remote_via(remote, nodes) if any(not is_this_host(node.host) for node in nodes) else "ssh"
    launches: list[NodeLaunch] = []
    shapes: dict[tuple[int, tuple[tuple[str, str], ...]], tuple[list[str], dict[str, str], list[str]]] = {}
    for index, node in enumerate(nodes):
        arguments = node_arguments(nodes, index, master_port=master_port, rest=rest)
        variables = node_variables(node, env, total_slots=hosts[node.host])
        if is_this_host(node.host):
            launcher = [sys.executable, "-m", "protrain.launcher", *arguments]
            launches.append(NodeLaunch(launcher, {**os.environ, **variables}))
        elif via == "ssh":
            command = remote_command(cwd, variables, arguments)
            launches.append(NodeLaunch(["ssh", "-o", "BatchMode=yes", node.host, command], via="ssh"))
        else:  # the first node of a shape gives its command; the others' hosts join it
            shape = (len(node.slots), tuple(sorted(variables.items())))
            shapes.setdefault(shape, (arguments, variables, []))[2].append(node.host)
    every_host = ",".join(node.host for node in nodes)
    for arguments, variables, targets in shapes.values():
        launches.append(_pdsh_launch(targets, arguments, variables, cwd=cwd, every_host=every_host))
    return launches


def _pdsh_launch(
    targets: list[str], arguments: list[str], variables: dict[str, str], *, cwd: Path, every_host: str
) -> NodeLaunch:
    """One pdsh for ``targets`` (hosts of one shape), as DeepSpeed's PDSH runner starts them; each
    finds its node rank from its name, which pdsh puts for %h, among ``every_host``."""
    at = arguments.index("--node-rank")  # the hidden options go first (remote_node.py reads them there)
    arguments = [NODE_RANK_OF, _HOST_MARK, NODE_HOSTS, every_host, *arguments[:at], *arguments[at + 2 :]]
    command = remote_command(cwd, variables, arguments)
    command = command.replace("%", "%%").replace(_HOST_MARK, "%h")  # pdsh substitutes % sequences
    argv = ["pdsh", "-S", "-f", PDSH_FANOUT, "-w", ",".join(targets), command]  # -S: the largest exit code
    # ssh, as DeepSpeed sets: only its module (and exec) substitutes %h in the command.
    return NodeLaunch(argv, {**os.environ, "PDSH_RCMD_TYPE": "ssh"}, via="pdsh")


def run_nodes(launches: list[NodeLaunch], *, cwd: Path) -> int:
    """Start every node and wait for all of them: the first to fail is the cause (its exit code
    is the job's), the others are stopped (``_stop``), then killed after the grace. A Ctrl-C
    stops every node (each stops after its step, saving a checkpoint where set); a second one
    kills them."""
    procs = [
        subprocess.Popen(
            launch.argv,
            cwd=cwd,
            env=launch.env,
            # Held open, never written: its end is a remote node's signal to stop (remote_node.py).
            stdin=None if launch.via == "local" else subprocess.PIPE,
            start_new_session=True,  # its own group: signalled as one
        )
        for launch in launches
    ]
    interrupts = [0]

    def on_interrupt(signum: int, frame: object) -> None:
        interrupts[0] += 1
        if interrupts[0] == 1:
            _stop(procs, launches, signal.SIGINT)
        else:
            _signal_all(procs, signal.SIGKILL)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    cause: int | None = None
    stopping_since: float | None = None
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            if all(code is not None for code in codes):
                break
            failed = [code for code in codes if code not in (None, EXIT_OK)]
            if failed and cause is None:
                cause = failed[0]
            if cause is not None and not interrupts[0] and stopping_since is None:
                _stop(procs, launches, signal.SIGTERM)
                stopping_since = time.monotonic()
            if stopping_since is not None and time.monotonic() - stopping_since > STOP_GRACE_S:
                _signal_all(procs, signal.SIGKILL)
            time.sleep(POLL_S)
    finally:
        signal.signal(signal.SIGINT, previous)
        _signal_all(procs, signal.SIGKILL)  # only if the head itself failed
        for proc in procs:
            proc.wait()
            _close_stdin(proc)
    if interrupts[0]:
        return EXIT_INTERRUPTED
    if cause is None:  # every node ended in the same look
        cause = next((proc.returncode for proc in procs if proc.returncode != EXIT_OK), EXIT_OK)
    return cause if cause >= 0 else 128 - cause


def _stop(procs: list[subprocess.Popen[bytes]], launches: list[NodeLaunch], signum: signal.Signals) -> None:
    """Ask each node still running to stop: one here by ``signum`` (SIGINT: Ctrl-C; SIGTERM: a
    failure elsewhere); a remote one by the end of its stdin. pdsh relays no stdin: it ends, which
    closes its ssh connections' stdin."""
    for proc, launch in zip(procs, launches, strict=True):
        if proc.poll() is not None:
            continue
        if launch.via == "local":
            _signal_group(proc, signum)
            continue
        _close_stdin(proc)
        if launch.via == "pdsh":
            _signal_group(proc, signal.SIGTERM)


def _signal_all(procs: list[subprocess.Popen[bytes]], signum: signal.Signals) -> None:
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signum)


def _signal_group(proc: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)


def _close_stdin(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()

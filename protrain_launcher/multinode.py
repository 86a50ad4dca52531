"""``protrain-run --hostfile FILE``: one ``protrain-run`` per host of the hostfile, this machine's
started directly, the others over ``ssh``; each told the job's node count, its node rank and the
first host as the master. The head waits for every node: the first to fail ends the others, and
its exit code is the job's; Ctrl-C reaches every node (a second one kills them).

A remote node runs ``cd <this directory> && env <forwarded variables> <this python> -m
protrain.launcher ...``: the same paths, Python environment and spec must exist there (a shared
file system), as with DeepSpeed's launcher. A remote node's ranks are not killed over ssh when
the job ends early: they stop when their peers are gone (the rendezvous or a collective fails).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from protrain.launcher.hostfile import Node, is_this_host
from protrain.launcher.request import EXIT_INTERRUPTED, EXIT_OK

DEFAULT_MASTER_PORT = 29500
"""torchrun's: the first host's rendezvous port unless launcher.master_port is set (the head cannot
ask a remote host for a free one)."""
POLL_S = 0.2
STOP_GRACE_S = 15.0
"""How long nodes get to end after the first failure (or a Ctrl-C) before they are killed."""


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


def node_command(
    node: Node, arguments: list[str], *, cwd: Path, env: dict[str, str], total_slots: int
) -> tuple[list[str], dict[str, str] | None]:
    """The command that starts one node, and (this machine) the environment it runs with."""
    variables = dict(env)
    if len(node.slots) != total_slots or list(node.slots) != list(range(len(node.slots))):
        variables["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, node.slots))
    launcher = [sys.executable, "-m", "protrain.launcher", *arguments]
    if is_this_host(node.host):
        return launcher, {**os.environ, **variables}
    assignments = [f"{name}={shlex.quote(value)}" for name, value in sorted(variables.items())]
    remote = f"cd {shlex.quote(str(cwd))} && env {' '.join(assignments)} {shlex.join(launcher)}"
    return ["ssh", "-o", "BatchMode=yes", node.host, remote], None


def run_nodes(commands: list[tuple[list[str], dict[str, str] | None]], *, cwd: Path) -> int:
    """Start every node and wait for all of them: the first to fail is the cause (its exit code
    is the job's), the others get SIGTERM, then SIGKILL after the grace. A Ctrl-C goes to every
    node (each stops after its step, saving a checkpoint where set); a second one kills them."""
    procs = [
        subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True)  # its own group: signalled as one
        for command, env in commands
    ]
    interrupts = [0]

    def on_interrupt(signum: int, frame: object) -> None:
        interrupts[0] += 1
        _signal_all(procs, signal.SIGINT if interrupts[0] == 1 else signal.SIGKILL)

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
                _signal_all(procs, signal.SIGTERM)
                stopping_since = time.monotonic()
            if stopping_since is not None and time.monotonic() - stopping_since > STOP_GRACE_S:
                _signal_all(procs, signal.SIGKILL)
            time.sleep(POLL_S)
    finally:
        signal.signal(signal.SIGINT, previous)
        _signal_all(procs, signal.SIGKILL)  # only if the head itself failed
        for proc in procs:
            proc.wait()
    if interrupts[0]:
        return EXIT_INTERRUPTED
    if cause is None:  # every node ended in the same look
        cause = next((proc.returncode for proc in procs if proc.returncode != EXIT_OK), EXIT_OK)
    return cause if cause >= 0 else 128 - cause


def _signal_all(procs: list[subprocess.Popen[bytes]], signum: signal.Signals) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass

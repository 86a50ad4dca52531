"""What the head of a ``--hostfile`` job (``multinode.py``) puts first on a remote node's command
line, and the node acts on before anything else: ``--stop-on-stdin-eof`` and, for a node started
by pdsh, ``--node-rank-of HOST --node-hosts H0,H1,...``. Hidden: the head writes them, not a user.

``--stop-on-stdin-eof``: ssh without a tty forwards no signal, so the head says "stop" by closing
the node's stdin (a lost connection closes it too). A thread reads stdin until it ends, then sends
this process SIGTERM, whose handling stops the ranks as a Ctrl-C does (each finishes its step,
saving a checkpoint where set; the agent kills them after ``launcher.shutdown_grace_s``). A job
that ends by itself exits first and never sees the end of its input.

``--node-rank-of``: one pdsh command starts all hosts of one shape, with ``%h`` replaced by each
host's name; the node's rank is that name's place in ``--node-hosts``, the job's hosts in order.
(pdsh's ``%n`` counts hosts in pdsh's own order, which it does not promise to be the -w order.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from protrain.launcher.signal_hold import STOP_SIGNALS
from protrain.runtime.config.spec_io import SpecError

STOP_ON_STDIN_EOF = "--stop-on-stdin-eof"
NODE_RANK_OF = "--node-rank-of"
NODE_HOSTS = "--node-hosts"
HIDDEN_OPTIONS = (STOP_ON_STDIN_EOF, NODE_RANK_OF, NODE_HOSTS)


def node_side_argv(argv: list[str]) -> list[str]:
    """``argv`` without the hidden options at its front: ``--node-rank-of``/``--node-hosts`` become
    ``--node-rank R``, and ``--stop-on-stdin-eof`` starts the watch of stdin. Anything else is
    returned as it is."""
    rest = list(argv)
    watch = False
    values: dict[str, str] = {}
    while rest and rest[0] in HIDDEN_OPTIONS:
        option = rest.pop(0)
        if option == STOP_ON_STDIN_EOF:
            watch = True
        elif not rest:
            raise SpecError(f"command line: {option} needs a value")
        else:
            values[option] = rest.pop(0)
    if values:
        if len(values) != 2:
            raise SpecError(f"command line: {NODE_RANK_OF} and {NODE_HOSTS} go together")
        host, hosts = values[NODE_RANK_OF], values[NODE_HOSTS].split(",")
        if host not in hosts:
            raise SpecError(f"command line: {NODE_RANK_OF} {host}: not one of {NODE_HOSTS} {values[NODE_HOSTS]}")
        rest = ["--node-rank", str(hosts.index(host)), *rest]
    if watch:
        watch_stdin()
    return rest


def watch_stdin() -> None:
    """Stop this protrain-run (SIGTERM to itself) once its stdin ends."""
    threading.Thread(target=_wait_for_eof, name="protrain-stdin-watch", daemon=True).start()


def _wait_for_eof() -> None:
    # Stop signals go to the main thread, not this one: where the main thread holds them back
    # (signal_hold: importing torch), they wait there instead of killing the process here.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass  # no stdin at all: as good as its end
    try:
        print("protrain-run: the head closed this node's input (the job ended early): stopping", file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # the connection, and so stderr, may be gone already
    os.kill(os.getpid(), signal.SIGTERM)  # the process, not this thread, which blocks it

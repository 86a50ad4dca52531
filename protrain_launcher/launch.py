"""Starting the ranks: torch.distributed's elastic agent (the engine under torchrun), with the
rendezvous, restarts and shutdown grace set explicitly from the spec.

The resolved spec is written once as JSON into the run directory; ranks find it through
``PROTRAIN_SPEC`` (a path, not the config itself).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from protrain.launcher.env_names import BAD_INPUT_PREFIX, LAUNCHER_PID_ENV, LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV
from protrain.launcher.request import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RANK_FAILED,
    LaunchRequest,
)
from protrain.launcher.signal_hold import import_torch
from protrain.launcher.slurm import SlurmJob
from protrain.runtime.config.spec import AUTO, Spec, auto_fields
from protrain.runtime.config.spec_io import RESOLVED_SPEC_ENV, ResolvedSpec, write_resolved

RANK_ENTRY = ("-u", "-m", "protrain.launcher.rank_entry")
RENDEZVOUS_TIMEOUT_S = 900
# The rendezvous variables a parent torchrun may have left; a child job must not inherit them.
_INHERITED_RENDEZVOUS_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def resolve_nproc(value: int | str) -> int:
    """``auto``: one rank per CUDA device, or 1 without CUDA."""
    if value != AUTO:
        return int(value)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def free_port(host: str) -> int:
    """A port the OS says is free on ``host`` (an IPv4 or IPv6 address or name of this host:
    protrain_launcher.preflight checked that it is one)."""
    family, _, _, _, address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address[0], 0))
        return int(sock.getsockname()[1])


def launch(request: LaunchRequest, spec: Spec) -> int:
    # Every later torch import is then a cache hit: none can swallow a Ctrl-C.
    import_torch()
    nproc = resolve_nproc(spec.launcher.nproc_per_node)
    world_size = nproc * spec.launcher.nnodes
    auto = tuple(auto_fields(spec))
    spec = spec.model_copy(update={"launcher": spec.launcher.model_copy(update={"nproc_per_node": nproc})})
    resolved = ResolvedSpec(
        spec=spec,
        source=str(request.config) if request.config else "(defaults)",
        overrides=tuple(override.source for override in request.overrides),
        auto=auto,
        dry_run=request.dry_run,
        world_size=world_size,
    )
    if request.dry_run:
        return _dry_run(request, resolved)
    run_dir = _new_run_dir(Path(spec.output_dir).expanduser(), spec.launcher.node_rank)
    spec_path = run_dir / "spec.json"
    write_resolved(resolved, spec_path)
    return _elastic_run(request, spec, nproc, spec_path, run_dir)


def _new_run_dir(base: Path, node_rank: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = base / f"{stamp}-node{node_rank}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def _child_env(spec_path: Path, nproc: int, slurm: SlurmJob | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED_RENDEZVOUS_VARS}
    env[RESOLVED_SPEC_ENV] = str(spec_path.resolve())
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    ranks_here = nproc
    if slurm is not None and slurm.per_task:  # this task is one of its node's ranks
        env[LOCAL_RANK_ENV], env[LOCAL_WORLD_SIZE_ENV] = str(slurm.local_id), str(slurm.tasks_here)
        ranks_here = slurm.tasks_here
    # Like torchrun: without a setting, ranks sharing a host split its cores instead of each
    # starting one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks_here)))
    return env


def _dry_run(request: LaunchRequest, resolved: ResolvedSpec) -> int:
    """One local process that plans and prints; no elastic agent, no process group, no files."""
    with tempfile.TemporaryDirectory(prefix="protrain-dry-run-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        write_resolved(resolved, spec_path)
        env = _child_env(spec_path, 1)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        command = [sys.executable, *RANK_ENTRY, str(request.script), *request.script_args]
        try:
            completed = subprocess.run(command, env=env, check=False)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    if completed.returncode < 0:
        return 128 - completed.returncode
    return completed.returncode


def _elastic_run(request: LaunchRequest, spec: Spec, nproc: int, spec_path: Path, run_dir: Path) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launcher = spec.launcher
    port = launcher.master_port or free_port(launcher.master_addr)
    # Static rendezvous when this node's rank is known (one node, or a node rank given);
    # otherwise torch's c10d rendezvous assigns node ranks as nodes join.
    static = launcher.nnodes == 1 or "node_rank" in launcher.model_fields_set
    # "timeout" is read by the static backend, "join_timeout" by c10d.
    rdzv_configs: dict[str, object] = {"timeout": RENDEZVOUS_TIMEOUT_S, "join_timeout": RENDEZVOUS_TIMEOUT_S}
    if static:
        rdzv_configs["rank"] = launcher.node_rank
    config = LaunchConfig(
        min_nodes=launcher.nnodes,
        max_nodes=launcher.nnodes,
        nproc_per_node=nproc,
        run_id=f"slurm-{request.slurm.job_id}" if request.slurm else f"protrain-{launcher.master_addr}-{port}",
        role="protrain",
        rdzv_endpoint=f"{launcher.master_addr}:{port}",
        rdzv_backend="static" if static else "c10d",
        rdzv_configs=rdzv_configs,
        max_restarts=launcher.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "elastic"), redirects=Std.NONE, tee=Std.NONE),
        shutdown_timeout=max(1, math.ceil(launcher.shutdown_grace_s)),
        # SIGINT is ours (see _InterruptAsTerminate): the agent stops ranks with SIGTERM.
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT",
    )
    _quiet_torch_elastic_logs()
    saved_env = dict(os.environ)
    os.environ.update(_child_env(spec_path, nproc, request.slurm))
    for name in _INHERITED_RENDEZVOUS_VARS:
        os.environ.pop(name, None)
    interrupt = _InterruptAsTerminate()
    try:
        with interrupt:
            elastic_launch(config, sys.executable)(*RANK_ENTRY, str(request.script), *request.script_args)
    except ChildFailedError as err:
        if interrupt.received:
            return EXIT_INTERRUPTED
        return _report_failures(err)
    except (SignalException, UnboundLocalError) as err:
        code = signal_exit_code(err, interrupted=interrupt.received)
        if code is None:
            raise
        return code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        # main(argv) may run in-process (tests, tools): leave the caller's environment as it was.
        os.environ.clear()
        os.environ.update(saved_env)
    return EXIT_OK


def signal_exit_code(err: BaseException, *, interrupted: bool) -> int | None:
    """protrain-run's exit code when the agent stopped on a signal: ``err`` is torch's
    SignalException, or the UnboundLocalError torch's elastic metrics wrapper (torch 2.13) raises
    from its ``finally`` when the signal came before it read the clock, with the SignalException
    as its context (the agent has stopped the ranks all the same). None for any other error."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if isinstance(err, UnboundLocalError):
        err = err.__context__  # type: ignore[assignment]
    if not isinstance(err, SignalException):
        return None
    signum = int(err.sigval)
    return EXIT_INTERRUPTED if interrupted or signum == signal.SIGINT else 128 + signum


class _InterruptAsTerminate:
    """Ctrl-C while the elastic agent runs becomes a SIGTERM to the agent, which then stops the
    ranks with SIGTERM. A rank that is still starting dies of it silently (its default action),
    while a forwarded SIGINT would raise KeyboardInterrupt wherever the rank happens to be (an
    import, a C++ callback) and print a traceback. Before the agent has its SIGTERM handler in
    place, Ctrl-C stays a KeyboardInterrupt (no rank exists yet)."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None

    def __enter__(self) -> _InterruptAsTerminate:
        self._previous = signal.signal(signal.SIGINT, self._on_interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _on_interrupt(self, signum: int, frame: object) -> None:
        if self.received:
            # A second Ctrl-C aborts now. The ranks die with this process (PR_SET_PDEATHSIG);
            # a checkpoint they were writing stays a .tmp directory, never loaded, removed by
            # the next save, and the previous checkpoint stays the latest.
            print("protrain-run: aborted", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        self.received = True
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            raise KeyboardInterrupt
        print(
            "protrain-run: stopping: each rank finishes its step (and saves a checkpoint when "
            "checkpoint.dir is set); Ctrl-C again aborts",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)


def _quiet_torch_elastic_logs() -> None:
    """The agent logs every shutdown at WARNING on its own loggers; we report outcomes ourselves."""
    for name in (
        "torch.distributed.elastic",
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "torch.distributed.elastic.multiprocessing.api",
        "torch.distributed.launcher.api",
    ):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _report_failures(err: object) -> int:
    """Name the rank that failed first as the cause; ranks the agent stopped afterwards (or that
    lost their peer) are listed as stopped, not as failures. Returns protrain-run's exit code:
    EXIT_BAD_INPUT when the cause stopped on bad input (exit code 2: a SpecError, whose message
    alone is printed, or the script's own usage error), else EXIT_RANK_FAILED."""
    failures = getattr(err, "failures", {}) or {}
    if not failures:
        print("protrain-run: the job failed", file=sys.stderr)
        return EXIT_RANK_FAILED
    first_rank = min(failures, key=lambda rank: _cause_order(rank, failures[rank]))
    first = failures[first_rank]
    code = EXIT_BAD_INPUT if getattr(first, "exitcode", 1) == EXIT_BAD_INPUT else EXIT_RANK_FAILED
    bad_input = _message(first)
    if code == EXIT_BAD_INPUT and bad_input.startswith(BAD_INPUT_PREFIX):
        print(f"protrain-run: error: {bad_input.removeprefix(BAD_INPUT_PREFIX)}", file=sys.stderr)
        return code
    print(f"protrain-run: rank {first_rank} failed with {_how(first)}{_detail(first)}", file=sys.stderr)
    others = sorted(rank for rank in failures if rank != first_rank)
    if others:
        print(f"protrain-run: stopped rank(s) {', '.join(map(str, others))} after that failure", file=sys.stderr)
    return code


def _cause_order(rank: int, failure: Any) -> tuple[int, int, int]:
    """Which failure caused the others. A rank that failed by itself (an error exit, or a crash
    such as SIGABRT or SIGSEGV) comes before one ended by a stop signal (the agent's SIGTERM or
    SIGKILL, or a Ctrl-C, whether the signal killed it or its handler exited with 128 + the
    signal: it was stopped, whatever it was printing then);
    then the earlier error, by its error file's time in nanoseconds (the recorded timestamp has
    whole seconds, so two ranks failing within a second would tie), then the lower rank."""
    code = getattr(failure, "exitcode", 1)
    killed = 1 if code in _STOP_SIGNAL_CODES else 0
    when_ns = int(getattr(failure, "timestamp", 0)) * 1_000_000_000
    error_file = getattr(failure, "error_file", "")
    if error_file:
        with contextlib.suppress(OSError):
            when_ns = os.stat(error_file).st_mtime_ns
    return killed, when_ns, rank


_STOP_SIGNAL_CODES = (
    -signal.SIGTERM,
    -signal.SIGKILL,
    -signal.SIGINT,
    # A rank's own handler ends it with 128 + the signal (rank_entry: a SIGTERM it caught quietly).
    128 + signal.SIGTERM,
    128 + signal.SIGINT,
)


def _how(failure: object) -> str:
    code = getattr(failure, "exitcode", 1)
    return f"signal {failure.signal_name()}" if code < 0 else f"exit code {code}"  # type: ignore[attr-defined]


def _message(failure: object) -> str:
    """The failure's message from its error file ("" when there is none)."""
    message = getattr(failure, "message", "")
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message).strip()


def _detail(failure: object) -> str:
    text = _message(failure)
    last_line = text.splitlines()[-1] if text else ""
    return f": {last_line}" if last_line and "To enable traceback" not in last_line else ""

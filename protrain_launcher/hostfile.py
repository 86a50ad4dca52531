"""DeepSpeed's hostfile and its ``--include``/``--exclude`` filters: which hosts a job runs on,
and which of each host's slots (GPUs).

A hostfile has one host per line, ``worker-0 slots=8``; ``#`` starts a comment. ``--include``
and ``--exclude`` take ``host[:slot,slot...]`` items joined by ``@`` (``worker-0:0,1@worker-1``):
include keeps only what they name (a host alone: all its slots), exclude drops it. Errors name
the file and line, or the filter and item.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ENV_FILE = ".protrain_env"
"""``KEY=VALUE`` lines forwarded to every node (DeepSpeed's ``.deepspeed_env``), read from the
working directory, else the home directory."""

FORWARDED_PREFIXES = ("PYTHON", "PROTRAIN_", "NCCL_", "CUDA_", "TORCH_", "OMP_", "HF_", "UCX_", "GLOO_")
"""Variables of this environment forwarded to every node as they are (``CUDA_VISIBLE_DEVICES``
aside: each node's comes from its slots)."""

_LINE = re.compile(r"(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\d+)")


class HostfileError(ValueError):
    """The hostfile or a filter is malformed or names what is not there."""


@dataclass(frozen=True, slots=True)
class Node:
    """One host of the job and the slots (device indices) its ranks use."""

    host: str
    slots: tuple[int, ...]


def read_hostfile(path: Path) -> dict[str, int]:
    """Host -> slot count, in the file's order."""
    try:
        text = path.read_text()
    except OSError as err:
        raise HostfileError(f"{path}: cannot be read ({err.strerror or err})") from None
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise HostfileError(f"{path}:{number}: {line!r} is not 'HOST slots=N'")
        host, slots = match["host"], int(match["slots"])
        if host in hosts:
            raise HostfileError(f"{path}:{number}: {host} is listed twice")
        if slots < 1:
            raise HostfileError(f"{path}:{number}: {host} has slots=0; give it at least 1 or leave it out")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"{path}: names no host ('HOST slots=N' per line)")
    return hosts


def select_nodes(hosts: dict[str, int], *, include: str | None, exclude: str | None) -> list[Node]:
    """The hosts and slots the filters leave, in the hostfile's order."""
    if include and exclude:
        raise HostfileError("--include and --exclude: give one of them, not both")
    if include:
        chosen = _parse_filter(include, hosts, "--include")
        nodes = [Node(host, tuple(chosen[host])) for host in hosts if host in chosen]
    else:
        dropped = _parse_filter(exclude, hosts, "--exclude") if exclude else {}
        nodes = []
        for host, count in hosts.items():
            slots = tuple(s for s in range(count) if s not in dropped.get(host, ()))
            if slots:
                nodes.append(Node(host, slots))
    if not nodes:
        raise HostfileError(f"{'--include' if include else '--exclude'} leaves no slot to run on")
    return nodes


def _parse_filter(text: str, hosts: dict[str, int], option: str) -> dict[str, list[int]]:
    chosen: dict[str, list[int]] = {}
    for item in text.split("@"):
        host, colon, slot_list = item.partition(":")
        if host not in hosts:
            raise HostfileError(f"{option} {text}: {host!r} is not in the hostfile ({', '.join(hosts)})")
        if not colon:
            chosen[host] = list(range(hosts[host]))
            continue
        slots = []
        for part in slot_list.split(","):
            if not part.isdigit() or int(part) >= hosts[host]:
                raise HostfileError(
                    f"{option} {text}: slot {part!r} of {host} is not one of 0-{hosts[host] - 1} (slots={hosts[host]})"
                )
            slots.append(int(part))
        chosen[host] = sorted(set(chosen.get(host, []) + slots))
    return chosen


def forwarded_env(environ: dict[str, str], cwd: Path, home: Path) -> dict[str, str]:
    """What every node's command sets: this environment's variables of ``FORWARDED_PREFIXES``,
    then the env file's lines (which win)."""
    env = {
        name: value
        for name, value in environ.items()
        if name.startswith(FORWARDED_PREFIXES) and name != "CUDA_VISIBLE_DEVICES"
    }
    for folder in (cwd, home):
        path = folder / ENV_FILE
        if path.is_file():
            for number, raw in enumerate(path.read_text().splitlines(), start=1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                name, eq, value = line.partition("=")
                if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name.strip()):
                    raise HostfileError(f"{path}:{number}: {line!r} is not 'NAME=VALUE'")
                env[name.strip()] = value
            break
    return env


def is_this_host(host: str) -> bool:
    """Whether ``host`` names this machine (its ranks start here, not over ssh)."""
    import socket

    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    return host in names or host == os.environ.get("HOSTNAME")

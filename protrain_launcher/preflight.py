"""Checks of the machine-facing spec values, made before any rank starts (and before torch is
imported): the run folder's place and the rendezvous address. Each failure is a SpecError naming
where the value came from (the file, a ``--set`` or a launcher option), the key, the value and
what would work; protrain-run turns it into exit code 2."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from protrain.runtime.config.spec import LauncherSpec
from protrain.runtime.config.spec_io import SpecError

EXAMPLE_OUTPUT_DIR = "runs"


def check_output_dir(path: Path, *, create: bool, source: str) -> None:
    """``output_dir`` must be a directory this process can write run folders into. ``create``:
    make it now (a launch); otherwise (a dry run) leave no trace, and check that it can be made:
    no component of the path is a file, and the nearest existing one takes a new directory.

    Writability is tried by making (and removing) a directory, not read from permission bits:
    root passes every permission check, yet cannot create directories under /proc or on a
    read-only filesystem."""
    where = f"{source}: output_dir: {path}"
    fix = f"give a directory this user can write (made when missing), e.g. --set output_dir={EXAMPLE_OUTPUT_DIR}"
    file = _file_on_path(path)
    if file is not None:
        what = "is a file" if file == path else f"cannot be a directory: {file} is a file"
        raise SpecError(f"{where} {what}; {fix}")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SpecError(f"{where} cannot be created ({err.strerror}); {fix}") from None
        place = path
    else:
        place = _nearest_existing(path)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".protrain-write-check-", dir=place))
    except OSError as err:
        target = "is not writable" if place == path else f"cannot be created in {place}"
        raise SpecError(f"{where} {target} ({err.strerror}); {fix}") from None


def _file_on_path(path: Path) -> Path | None:
    """The first existing component of ``path`` (itself included) that is not a directory."""
    for part in [*reversed(path.parents), path]:
        if part.exists() and not part.is_dir():
            return part
    return None


def _nearest_existing(path: Path) -> Path:
    for part in [path, *path.parents]:
        if part.exists():
            return part
    return Path(path.anchor or ".")


def check_master_addr(launcher: LauncherSpec, *, source: str) -> None:
    """``master_addr`` must resolve here (every node connects to it). Where this node serves the
    rendezvous store (static rendezvous, node rank 0: one node, or ``--node-rank 0``), it must
    also be one of this host's addresses: otherwise the agent would wait the whole rendezvous
    timeout for a store that never answers. With ``master_port`` 0 this is the bind that picks
    the free port. (Under c10d rendezvous, node ranks given as nodes join, the node whose address
    it is serves the store.)"""
    addr = launcher.master_addr
    key = f"{source}: launcher.master_addr: {addr!r}"
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        reason = err.strerror if isinstance(err, socket.gaierror) else str(err)
        raise SpecError(
            f"{key} does not resolve ({reason}); give the host name or IP address of the node that "
            "runs rank 0, as every node can resolve it (127.0.0.1 on a single node)"
        ) from None
    static = launcher.nnodes == 1 or "node_rank" in launcher.model_fields_set
    if not static or launcher.node_rank != 0:
        return
    family, _, _, _, sockaddr = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((sockaddr[0], 0))
    except OSError as err:
        raise SpecError(
            f"{key} is not an address of this host ({err.strerror}), but node rank 0 serves the "
            "rendezvous: on one node use 127.0.0.1; on several, this host's name or address"
        ) from None


def key_source(config: Path | None, sources: dict[tuple[str, ...], str], key_path: tuple[str, ...]) -> str:
    """Where a key's value came from: the last ``--set`` or launcher option that set it, else the
    spec file (or the defaults)."""
    return sources.get(key_path) or (str(config) if config is not None else "(defaults)")

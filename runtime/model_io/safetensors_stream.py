"""Writing safetensors files tensor by tensor, as the tensors arrive, in shards with an index.

The ``safetensors`` library serializes a whole dict of tensors at once (and copies each into a
bytes object first): a model saved through it is held whole in host memory, twice. An export
streams instead: every tensor's name, dtype and shape are known before the first value arrives
(the chunk layout says them), so each file's header is written first and each tensor's bytes go
to disk when its chunk has been gathered; no more than one chunk is ever held (see
``runtime.chunks.readout``).

The format is safetensors' own (an 8-byte little-endian header length, a JSON header of dtypes,
shapes and data offsets, then the bytes), read back by ``safetensors.safe_open``. Files are
split as Hugging Face's ``save_pretrained`` splits them (``max_shard_size``: a file holds tensors
up to that size; a larger tensor has a file of its own), named ``<stem>-00001-of-00003.safetensors``
beside an index ``<stem>.safetensors.index.json`` (``{"metadata": {"total_size": ...},
"weight_map": {name: file}}``), or one ``<stem>.safetensors`` when one file holds them all. Each
file is written under a temporary name and renamed when complete; a failure removes them.
"""

from __future__ import annotations

import json
import os
import re
import struct
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from protrain.runtime.hw.durable import fsync_path

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""ProTrain's default: a host holds at most one file's worth while an export is written."""

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def size_bytes(size: int | str) -> int:
    """``max_shard_size`` as Hugging Face reads it: bytes, or "5GB" (10^9) / "5GiB" (2^30)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f'max_shard_size must be a positive number of bytes or a size like "5GB" or "500MiB", got {size!r}'
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of an export: its name and what it is written as."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


def split_into_files(entries: Iterable[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Consecutive runs of ``entries`` (in arrival order) of at most ``max_shard_bytes`` each, a
    larger tensor alone in its run (Hugging Face's rule)."""
    files: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in entries:
        if current and size + entry.nbytes > max_shard_bytes:
            files.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current or not files:
        files.append(current)
    return files


def _header(entries: list[Entry], metadata: Mapping[str, str]) -> bytes:
    body: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for entry in entries:
        if entry.dtype not in _DTYPES:
            raise ValueError(f"{entry.name}: dtype {entry.dtype} cannot be written to safetensors")
        body[entry.name] = {
            "dtype": _DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


class ShardedWriter:
    """Writes ``entries`` (every tensor, in the order they will arrive) into ``directory`` as
    ``<stem>.safetensors`` or shards with an index (see the module docstring). ``add`` takes
    each tensor in that order; ``finish`` renames the files into place; ``abort`` removes them."""

    def __init__(
        self,
        directory: Path,
        entries: list[Entry],
        *,
        name: str = "model.safetensors",
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        metadata: Mapping[str, str] | None = None,
        index_metadata: Mapping[str, object] | None = None,
    ) -> None:
        """``name``: the one file's name; shards take its stem (``model-00001-of-00002...``)
        and the index is ``<name>.index.json``. ``metadata``: the (first) file's header strings;
        ``index_metadata``: more entries of the index's ``metadata``."""
        self.directory = directory
        self.name = name
        self.files = split_into_files(entries, size_bytes(max_shard_size))
        count = len(self.files)
        stem = name.removesuffix(".safetensors")
        self.names = (
            [name] if count == 1 else [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        )
        self.index_name = None if count == 1 else f"{name}.index.json"
        self._metadata = {"format": "pt", **(metadata or {})}
        self._index_metadata = dict(index_metadata or {})
        self._pending = [(entry, file) for file, run in enumerate(self.files) for entry in run]
        self._next = 0
        self._handle: BinaryIO | None = None
        self._temps: list[Path] = []
        directory.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor's value (host memory; cast to its entry's dtype here)."""
        entry, file = self._pending[self._next]
        if name != entry.name or tuple(tensor.shape) != entry.shape:
            raise ValueError(f"export: expected {entry.name} {entry.shape}, got {name} {tuple(tensor.shape)}")
        if self._handle is None or file != len(self._temps) - 1:
            self._open(file)
        assert self._handle is not None
        value = tensor.detach()
        if value.dtype != entry.dtype:
            value = value.to(entry.dtype)
        value = value.contiguous().reshape(-1)
        self._handle.write(value.view(torch.uint8).numpy().data)  # the array's buffer, as a memoryview
        self._next += 1

    def _open(self, file: int) -> None:
        self._close_handle()
        fd, name = tempfile.mkstemp(dir=self.directory, prefix=f".{self.names[file]}.", suffix=".tmp")
        self._temps.append(Path(name))
        self._handle = os.fdopen(fd, "wb")
        metadata = self._metadata if file == 0 or self.index_name is None else {"format": "pt"}
        self._handle.write(_header(self.files[file], metadata))

    def _close_handle(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None

    def finish(self) -> list[Path]:
        """Every tensor has arrived: the files (and the index) go into place; their paths."""
        if self._next != len(self._pending):
            missing = self._pending[self._next][0].name
            raise RuntimeError(f"export: {len(self._pending) - self._next} tensors never arrived (first: {missing})")
        if not self._temps:  # no tensor at all: one empty file
            self._open(0)
        self._close_handle()
        written = []
        for temp, name in zip(self._temps, self.names, strict=True):
            os.replace(temp, self.directory / name)
            written.append(self.directory / name)
        self._temps = []
        if self.index_name is not None:
            index = {
                "metadata": {
                    "total_size": sum(entry.nbytes for run in self.files for entry in run),
                    **self._index_metadata,
                },
                "weight_map": {
                    entry.name: name for run, name in zip(self.files, self.names, strict=True) for entry in run
                },
            }
            path = self.directory / self.index_name
            _write_text(path, json.dumps(index, indent=2, sort_keys=True) + "\n")
            written.append(path)
        fsync_path(self.directory)
        return written

    def abort(self) -> None:
        """Remove what was written (a failure before ``finish``)."""
        try:
            if self._handle is not None:
                self._handle.close()
        finally:
            self._handle = None
            for temp in self._temps:
                temp.unlink(missing_ok=True)
            self._temps = []


def _write_text(path: Path, text: str) -> None:
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(name, path)


def remove_stale(directory: Path, name: str, written: Iterable[Path]) -> None:
    """Remove the files an earlier save under ``name`` left that this one did not write (its
    shards or index, when the number of files changed), as ``save_pretrained`` does."""
    stem = re.escape(name.removesuffix(".safetensors"))
    pattern = re.compile(rf"{stem}(-\d{{5}}-of-\d{{5}})?\.safetensors|{re.escape(name)}\.index\.json")
    keep = {path.name for path in written}
    for path in directory.iterdir():
        if path.is_file() and pattern.fullmatch(path.name) and path.name not in keep:
            path.unlink()


def load_sharded(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the export at ``path`` (one file, or ``<path>.index.json`` and its
    shards) on the CPU, and the first file's metadata merged with the index's string entries."""
    from safetensors import safe_open

    index_path = Path(f"{path}.index.json")
    if not path.exists() and index_path.exists():
        index = json.loads(index_path.read_text(encoding="utf-8"))
        files = sorted(set(index["weight_map"].values()), key=str)
        extra = {k: v for k, v in index.get("metadata", {}).items() if isinstance(v, str)}
    else:
        files, extra = [path.name], {}
    values: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for number, file in enumerate(files):
        with safe_open(str(path.parent / file), framework="pt") as handle:
            values.update({name: handle.get_tensor(name) for name in handle.keys()})
            if number == 0:
                metadata = dict(handle.metadata() or {})
    return values, {**metadata, **extra}

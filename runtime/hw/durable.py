"""Making file-system changes durable: what checkpoints and exports rely on for atomicity."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename, a new file), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

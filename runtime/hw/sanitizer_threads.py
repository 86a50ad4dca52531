"""CUDA's sanitizer on the engine's worker threads too. Part of the device layer.

``TORCH_CUDA_SANITIZER=1`` makes torch enter its sanitizer's dispatch mode at import, on the
importing thread only: torch keeps the mode stack per thread, so the side stream's, the host
worker's and the upload thread's operators (every gather, reduction and staging copy) went
unseen, and those are where stream-ordering bugs live. Each worker enters a mode here that hands
every operator to the one sanitizer, whose event handler then sees every thread's accesses.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class _ToTheSanitizer(TorchDispatchMode):
    """Hands each operator to the process's sanitizer mode (its event handler is shared)."""

    def __init__(self, sanitizer_mode: TorchDispatchMode) -> None:
        super().__init__()
        self._sanitizer_mode = sanitizer_mode

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self._sanitizer_mode.__torch_dispatch__(func, types, args, kwargs)


def active_sanitizer_mode() -> TorchDispatchMode | None:
    """The CUDA sanitizer's dispatch mode when torch enabled it (None otherwise, and without
    importing the sanitizer: only ``TORCH_CUDA_SANITIZER`` loads it)."""
    module = sys.modules.get("torch.cuda._sanitizer")
    sanitizer = None if module is None else getattr(module, "cuda_sanitizer", None)
    if sanitizer is None or not getattr(sanitizer, "enabled", False):
        return None
    return sanitizer.dispatch


def sanitized_here(mode: TorchDispatchMode | None) -> contextlib.AbstractContextManager[Any]:
    """On a worker thread: ``mode`` (the creating thread's ``active_sanitizer_mode()``) sees
    this thread's operators too."""
    return contextlib.nullcontext() if mode is None else _ToTheSanitizer(mode)

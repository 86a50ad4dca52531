"""ProTrain's runtime: the job spec, ``initialize`` and the ``Engine``.

``import protrain.runtime.config.spec`` must stay free of torch (the launcher validates input without it), so the
training API is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protrain.runtime.config.job import current_spec
    from protrain.runtime.entry import initialize
    from protrain.runtime.training.engine import Engine

__all__ = ["Engine", "current_spec", "initialize"]


def __getattr__(name: str) -> Any:
    if name in ("initialize", "current_spec"):
        import importlib

        home = "protrain.runtime.entry" if name == "initialize" else "protrain.runtime.config.job"
        return getattr(importlib.import_module(home), name)
    if name == "Engine":
        from protrain.runtime.training.engine import Engine

        return Engine
    raise AttributeError(f"module 'protrain.runtime' has no attribute {name!r}")

"""ProTrain: train large language models on far less device memory than they need.

``import protrain`` is cheap (no torch): the launcher validates a job spec without it, so the
training API is loaded on first use::

    import protrain
    engine = protrain.initialize(model, config="job.yaml", example_batch=batch)

Installed, the repository's folders are subpackages of this one: ``protrain.runtime``,
``protrain.profiler`` and ``protrain.launcher`` (``protrain-run``). This file is the package's
``__init__`` (setup.cfg's ``package_dir``); it lives inside ``runtime/`` rather than in a
``protrain/`` folder at the top of the repository, which would shadow the installed package for
any process that has a checkout on its path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from protrain.runtime.config.job import current_spec
    from protrain.runtime.entry import initialize
    from protrain.runtime.integrations.hf import ProTrainMixin, ProTrainTrainer
    from protrain.runtime.training.engine import Engine

__version__ = "0.1.0"

# name -> the module that defines it; the Trainer integration imports transformers, so it is only
# loaded when asked for.
_LAZY = {
    "initialize": "protrain.runtime.entry",
    "current_spec": "protrain.runtime.config.job",
    "Engine": "protrain.runtime.training.engine",
    "ProTrainTrainer": "protrain.runtime.integrations.hf",
    "ProTrainMixin": "protrain.runtime.integrations.hf",
}

__all__ = ["Engine", "ProTrainMixin", "ProTrainTrainer", "__version__", "current_spec", "initialize"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'protrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

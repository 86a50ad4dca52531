"""The model's own key/value cache is off in training forwards.

A Hugging Face decoder called with ``use_cache`` fills a cache object as its forward runs: each
layer's self-attention keys and values and, in an encoder-decoder model, its cross-attention keys
and values, marked "computed" once stored. A block recomputed in backward (``checkpoint`` mode)
then runs against the filled cache and takes another path: T5's and BART's decoder layers read
the cross-attention keys and values from the cache instead of projecting the encoder output, so
the recomputation saves fewer tensors than the original forward and ``torch.utils.checkpoint``
refuses ("A different number of tensors was saved during the original forward and
recomputation"). The cache also keeps every layer's keys and values referenced from the output,
so an offloaded block could not free them. Training never reads it; Hugging Face's own gradient
checkpointing turns it off for the first reason.

So the engine's training forwards and backwards, and the profiling steps, run with every
``use_cache`` the model's modules' configs hold set to False, and put back afterwards (a
submodule may own a copy of the config: T5's decoder stack does). Evaluation and generation
through the engine keep the cache. A ``use_cache`` the caller passes explicitly is the caller's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn


def cache_configs(model: nn.Module) -> tuple[Any, ...]:
    """The distinct config objects of ``model``'s modules that carry a ``use_cache`` setting."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and isinstance(getattr(config, "use_cache", None), bool):
            found.setdefault(id(config), config)
    return tuple(found.values())


@contextlib.contextmanager
def caches_off(configs: Sequence[Any]) -> Iterator[bool]:
    """``use_cache`` False in each of ``configs`` for the duration, then as it was; yields whether
    any was on (so the caller can say so)."""
    turned_off = [config for config in configs if config.use_cache]
    for config in turned_off:
        config.use_cache = False
    try:
        yield bool(turned_off)
    finally:
        for config in turned_off:
            config.use_cache = True


CACHE_OFF_NOTE = (
    "use_cache=False in training: the model's key/value cache would make recomputed blocks differ "
    "from their forward and keep activations alive (pass use_cache explicitly to override)"
)
"""What the engine prints once, on rank 0, the first time it turns a cache off."""


class TrainingCaches:
    """One engine's model caches: off in its training forwards and backwards, the note said once
    (``log``) when that changes what the caller's forward does."""

    def __init__(self, model: nn.Module, *, log: Callable[[str], None]) -> None:
        self._configs = cache_configs(model)
        self._log = log
        self._noted = False

    @contextlib.contextmanager
    def off(self, training: bool, *, note: bool) -> Iterator[None]:
        """Caches off when ``training``; ``note``: say so, once, if one was on."""
        if not training:
            yield
            return
        with caches_off(self._configs) as turned_off:
            if turned_off and note and not self._noted:
                self._noted = True
                self._log(CACHE_OFF_NOTE)
            yield


def refuse_cache_with_recompute(kwargs: dict[str, Any], *, recomputes: bool) -> None:
    """A training forward explicitly asked for a cache while blocks are recomputed: the
    recomputation would see the filled cache and fail in backward; say so now, with the fix."""
    if recomputes and kwargs.get("use_cache") is True:
        raise ValueError(
            "use_cache=True in a training forward while the plan recomputes blocks (checkpoint "
            "mode): the cache filled in forward makes the recomputation differ and backward fail; "
            "drop use_cache (the engine turns it off in training) or pass use_cache=False"
        )

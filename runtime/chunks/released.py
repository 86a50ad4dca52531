"""Reading a parameter whose chunk is not on the device raises, naming it and the fix.

While an offloaded chunk is not in a device buffer its parameters point at a NaN placeholder
(store.py): autograd needs their shapes, never their values. Code that reads such a parameter
outside the forward of the module that owns it (TRL's fused loss reads ``lm_head.weight``
directly; a callback that logs a weight's norm; ``model.state_dict()``) would compute on the
placeholder and see NaN several steps later, far from the cause. So a parameter the store
releases becomes a ``ChunkParameter``: an ``nn.Parameter`` in every other respect, whose
``__torch_function__`` refuses any operation but its metadata (shape, dtype, gradient, ...) while
it is released, and whose ``.data`` is then a ``ReleasedData`` that refuses the same. The check is
one dict lookup per operation on such a parameter; a resident one computes as a plain parameter
(results are plain tensors, as ``nn.Parameter``'s own are).

The registry is keyed by ``id`` with a weak reference to the parameter (tensors compare by value,
so they cannot be dict keys that are ever compared), dropped when the parameter dies.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["ChunkParameter", "ReleasedParameterError", "mark_released", "mark_resident", "names_only", "released_name"]

GATHER_HINT = (
    "read it inside the forward of the module that owns it, or gather it for the read: "
    "`with engine.gathered([param]): ...` (under the Trainer: trainer.protrain_engine.gathered); "
    "engine.state_dict() gives every value"
)
CLOSED_HINT = "its engine was closed, and its values with it: read them from a checkpoint or an export"


class ReleasedParameterError(RuntimeError):
    """A parameter was read while its chunk was off the device (the message names it and the fix)."""


_RELEASED: dict[int, tuple[weakref.ref[torch.Tensor], str, str]] = {}
"""id(parameter) -> (the parameter, its name, what to do instead)."""
_names_only = 0
"""Inside ``names_only``: reads pass (the caller keeps names and shapes, never values)."""


class _TensorAttribute(Protocol):
    """A tensor attribute as its class holds it: a descriptor."""

    def __get__(self, tensor: torch.Tensor, owner: type | None = None, /) -> torch.Tensor: ...

    def __set__(self, tensor: torch.Tensor, value: torch.Tensor, /) -> None: ...


_DATA: _TensorAttribute = inspect.getattr_static(torch.Tensor, "data")
"""``Tensor.data``'s descriptor (torch's stubs type ``Tensor.data`` on the class as a tensor)."""


def _names(*attributes: str) -> set[Callable[..., Any]]:
    found: set[Callable[..., Any]] = set()
    for attribute in attributes:
        member = getattr(torch.Tensor, attribute)
        found |= {member.__get__, member.__set__} if hasattr(member, "__set__") else {member}
    return found


_METADATA = frozenset(
    _names(
        "shape",
        "dtype",
        "device",
        "requires_grad",
        "grad",
        "is_leaf",
        "grad_fn",
        "ndim",
        "layout",
        "is_cuda",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_nested",
        "itemsize",
        "nbytes",
        "_version",
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "element_size",
        "stride",
        "storage_offset",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
        "get_device",
        "requires_grad_",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "data_ptr",
        "untyped_storage",
        "is_pinned",
        "__len__",
        "retains_grad",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
        "_grad",
        "_grad_fn",
        "_base",
        "name",
    )
    | {_DATA.__set__}
)
"""What may be asked of a released parameter: its metadata, its gradient, where it points."""
_DATA_GET = _DATA.__get__


def _released_entry(value: Any) -> tuple[str, str] | None:
    entry = _RELEASED.get(id(value))
    if entry is not None and entry[0]() is value:
        return entry[1], entry[2]
    return None


def _first_released(args: Iterable[Any], kwargs: dict[str, Any]) -> tuple[str, str] | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            for item in value:
                if (entry := _released_entry(item)) is not None:
                    return entry
        elif (entry := _released_entry(value)) is not None:
            return entry
    return None


def _refusal(name: str, hint: str, func: Any) -> ReleasedParameterError:
    what = getattr(func, "__name__", str(func))
    return ReleasedParameterError(
        f"{name} was read ({what}) while its chunk is off the device: it holds no values here; {hint}"
    )


class ChunkParameter(nn.Parameter):
    """A parameter in a chunk the engine may move off the device (see the module docstring)."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _RELEASED and not _names_only and func not in _METADATA:
            released = _first_released(args, kwargs)
            if released is not None:
                if func == _DATA_GET:  # a bound-method wrapper: equal, never identical
                    return ReleasedData.of(args[0], *released)
                raise _refusal(*released, func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class ReleasedData(torch.Tensor):
    """``.data`` of a released parameter: its metadata, and a refusal for anything else."""

    _protrain_released: tuple[str, str]

    @staticmethod
    def of(param: torch.Tensor, name: str, hint: str) -> ReleasedData:
        with torch._C.DisableTorchFunctionSubclass():
            data = _DATA_GET(param)
        view = torch.Tensor._make_subclass(ReleasedData, data)
        view._protrain_released = (name, hint)
        return view

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func not in _METADATA and not _names_only:
            values = [
                v for a in (*args, *(kwargs or {}).values()) for v in (a if isinstance(a, list | tuple) else (a,))
            ]
            view = next(v for v in values if isinstance(v, ReleasedData))  # one is, or torch would not ask
            raise _refusal(*view._protrain_released, func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def names_only() -> Iterator[None]:
    """For library code asked only which names or shapes it would take (PEFT's choice of adapter
    keys runs ``state_dict()`` over the model): released parameters are not refused meanwhile."""
    global _names_only
    _names_only += 1
    try:
        yield
    finally:
        _names_only -= 1


def mark_released(param: nn.Parameter, name: str, *, closed: bool = False) -> None:
    """``param`` points at a placeholder from now on: reads of it are refused. A plain
    ``nn.Parameter`` becomes a ``ChunkParameter`` (another subclass, such as a quantized
    library's, is left as it is, unguarded)."""
    if type(param) is nn.Parameter:
        param.__class__ = ChunkParameter
    key = id(param)
    _RELEASED[key] = (weakref.ref(param, lambda _ref: _RELEASED.pop(key, None)), name,
                      CLOSED_HINT if closed else GATHER_HINT)  # fmt: skip


def mark_resident(param: nn.Parameter) -> None:
    """``param`` points at real values again."""
    _RELEASED.pop(id(param), None)


def released_name(param: torch.Tensor) -> str | None:
    """The name a released parameter was registered under; None for one that holds values."""
    entry = _released_entry(param)
    return None if entry is None else entry[0]

"""How the Engine exposes what its parts hold and do: a value one of them holds is read there at
each access (``Reads``), a call one of them answers is that part's method (``delegate``), and an
engine call runs under the device wall (``device_call``: what it allocates on the device counts
to the engine's budget, runtime/hw/device_wall.py, whoever allocates it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from protrain.runtime.hw import device_wall

_F = TypeVar("_F", bound=Callable[..., Any])
_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")


class WalledEngine(Protocol):
    _wall: device_wall.Account | None
    """The engine's count under the device wall (None: the wall is down)."""


def device_call(operation: str) -> Callable[[_F], _F]:
    """Decorate an Engine method: it runs as ``engine.<operation>`` under the engine's account."""

    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def call(self: WalledEngine, *args: Any, **kwargs: Any) -> Any:
            with device_wall.engine_call(self._wall, f"engine.{operation}"):
                return method(self, *args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def delegate(
    part: str, method: Callable[Concatenate[Any, _P], _R], *, wall: str | None = None
) -> Callable[Concatenate[Any, _P], _R]:
    """An Engine method that is ``method`` of the engine's part at attribute ``part``: the same
    signature, types and docstring (one place to document each call), run under the device wall
    as ``engine.<wall>`` when ``wall`` is given."""

    @functools.wraps(method)
    def call(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        owner = getattr(self, part)
        if wall is None:
            return method(owner, *args, **kwargs)
        with device_wall.engine_call(self._wall, f"engine.{wall}"):
            return method(owner, *args, **kwargs)

    return call


class Reads(Generic[_T]):
    """A read-only engine attribute: ``path`` (dotted, from the engine) read at each access, so
    it follows what a plan switch or a checkpoint load changes. ``Reads[int]("_state.progress.global_step")``."""

    def __init__(self, path: str, doc: str | None = None) -> None:
        self._get = attrgetter(path)
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, engine: None, owner: type) -> Reads[_T]: ...

    @overload
    def __get__(self, engine: object, owner: type) -> _T: ...

    def __get__(self, engine: object | None, owner: type) -> Reads[_T] | _T:
        if engine is None:
            return self
        return self._get(engine)  # type: ignore[no-any-return]

    def __set__(self, engine: object, value: _T) -> None:
        raise AttributeError(f"engine.{self._name} is read-only")

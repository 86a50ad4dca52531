"""The device wall: with ``PROTRAIN_STRICT_DEVICE=1`` the device tier holds no more than the live
engines' budgets, on CPU as on a GPU, and passing one raises at once (DESIGN section 6).

Part of the device layer (runtime/hw/device.py). Each engine opens an ``Account`` with its
``device_budget`` when it claims the device (runtime/training/live_engines.py) and closes it when
it is released.

- **CUDA**: ``torch.cuda.set_per_process_memory_fraction`` caps the caching allocator at the sum
  of the live engines' budgets; the allocator raises its own out-of-memory error.
- **CPU**, where the "device" is the process's RAM and nothing else would stop it: every tensor
  storage created on the compute device while an engine call runs (``engine_call``: whoever
  allocates it, the engine, the model's forward, a hook, a save) counts against that engine's
  account, as CUDA's allocator would count it: by storage, at creation, released when the storage
  is freed (``weakref.finalize`` on it); views and in-place ops count nothing. The count is kept
  by a ``TorchDispatchMode`` on the calling thread and on the threads that issue device work for
  it (a side stream inherits its creator's call). Host memory is not the device: host regions
  (runtime/hw/host_memory.py, carved from mmaps by no aten op) never pass through the count, and
  host buffers made with plain torch are allocated under ``host_allocations()``. An account that
  passes its budget raises ``DeviceBudgetExceeded`` naming the operation, the bytes and the budget.

Accounts are per engine, so each engine's measured peak is its own (two engines in one process
each hold to their own budget; on CUDA the fraction is their sum).
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ENV = "PROTRAIN_STRICT_DEVICE"


TRACE_ENV = "PROTRAIN_WALL_TRACE"


def strict() -> bool:
    """Whether the wall is up (read when an engine opens its account)."""
    return os.environ.get(ENV, "") not in ("", "0")


class DeviceBudgetExceeded(torch.OutOfMemoryError):
    """An engine's device tier passed its ``memory.device_budget`` (the wall is up): CUDA's
    out-of-memory error on CPU, so that whatever handles one (a profiling step that does not
    fit) handles both."""

    def __init__(
        self, *, account: str, operation: str, nbytes: int, total: int, budget: int, besides: str = ""
    ) -> None:
        self.operation, self.nbytes, self.total, self.budget = operation, nbytes, total, budget
        whose = "the device's live engines' memory.device_budget together" if besides else "its memory.device_budget"
        super().__init__(
            f"{account}: {operation} allocated {nbytes:,} bytes on the device, which brings "
            f"{'the device' if besides else 'it'} to {total:,} bytes{besides}, over {whose} of {budget:,} bytes "
            f"({ENV}=1: on a GPU of that size this is an out-of-memory error; {TRACE_ENV}=1 "
            "lists what holds the memory)"
        )


@dataclass(eq=False)
class Account:
    """One engine's device tier under the wall."""

    label: str
    budget: int
    device: torch.device
    live_bytes: int = 0
    """Bytes of the storages counted to this engine that are still alive."""
    highest: int = 0
    """The most ``live_bytes`` since the last ``take_highest`` (CPU)."""
    closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, operation: str) -> DeviceBudgetExceeded | None:
        """Count ``nbytes``; the error to raise when they pass the budget, or when the device as
        a whole passes the live engines' budgets together (CUDA's cap): what a closed engine
        left alive still counts there, as CUDA's allocator still holds it."""
        with self._lock:
            self.live_bytes += nbytes
            self.highest = max(self.highest, self.live_bytes)
            total = self.live_bytes
        if self.closed:
            return None
        if total > self.budget:
            return DeviceBudgetExceeded(
                account=self.label, operation=operation, nbytes=nbytes, total=total, budget=self.budget
            )
        held, cap, left = _device_totals(self.device)
        if held > cap:
            return DeviceBudgetExceeded(
                account=self.label,
                operation=operation,
                nbytes=nbytes,
                total=held,
                budget=cap,
                besides=f"; of those, {left:,} bytes are still held by closed engines (their storages alive)",
            )
        return None

    def remove(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes

    def take_highest(self) -> int:
        """The most bytes held since the last call (then restarted from what is held now)."""
        with self._lock:
            highest, self.highest = self.highest, self.live_bytes
        return highest


_accounts: list[Account] = []
_accounts_lock = threading.Lock()
_holding: weakref.WeakSet[Account] = weakref.WeakSet()
"""Every account, open or closed, while it may still count live storages (each storage's
finalizer holds its account)."""


def _device_totals(device: torch.device) -> tuple[int, int, int]:
    """(live bytes of every account on ``device``, the open ones' budgets together, the live
    bytes of the closed ones)."""
    accounts = list(_holding)
    mine = [a for a in accounts if a.device == device]
    closed = sum(a.live_bytes for a in mine if a.closed)
    return sum(a.live_bytes for a in mine), sum(a.budget for a in mine if not a.closed), closed


def open_account(label: str, budget: int, device: torch.device) -> Account | None:
    """Register an engine's budget; None when the wall is down. On CUDA the allocator's cap
    becomes the sum of the live engines' budgets."""
    if not strict():
        return None
    account = Account(label=label, budget=budget, device=device)
    with _accounts_lock:
        _accounts.append(account)
        _holding.add(account)
        _cap_cuda(device)
    return account


def close_account(account: Account | None) -> None:
    if account is None or account.closed:
        return
    account.closed = True
    with _accounts_lock:
        _accounts.remove(account)
        _cap_cuda(account.device)


def _cap_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    budgets = sum(a.budget for a in _accounts if a.device == device)
    fraction = 1.0 if not budgets else min(1.0, budgets / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)


# ------------------------------------------------------------------------------------------------
# The count on CPU
# ------------------------------------------------------------------------------------------------


class _Thread(threading.local):
    mode: _CountingMode | None = None
    suspended: int = 0


_thread = _Thread()
_trace = os.environ.get(TRACE_ENV, "") not in ("", "0")
_fresh_returns: dict[Any, tuple[bool, ...]] = {}
"""Per op, which of its returns are new memory (no alias annotation in its schema)."""


def _fresh(func: Any) -> tuple[bool, ...]:
    found = _fresh_returns.get(func)
    if found is None:
        found = tuple(ret.alias_info is None for ret in func._schema.returns)
        _fresh_returns[func] = found
    return found


_traced: dict[int, tuple[int, str]] = {}
"""With ``PROTRAIN_WALL_TRACE=1``: per live counted storage, its bytes and where it was made."""


def _release(account: Account, nbytes: int, key: int) -> None:
    account.remove(nbytes)
    _traced.pop(key, None)


def _allocation_site(operation: str) -> str:
    """The call that made a storage: the innermost frame outside torch, and the operation."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("device_wall.py"):
            return f"{operation} at {frame.filename}:{frame.lineno} ({frame.name})"
    return operation


def largest_live(account: Account, count: int = 8) -> list[tuple[int, str]]:
    """The largest storages counted to ``account`` and still alive, with where each was made
    (recorded only with ``PROTRAIN_WALL_TRACE=1``)."""
    mine = [entry for entry in list(_traced.values()) if entry[1].startswith(account.label + ":")]
    return sorted(mine, key=lambda entry: -entry[0])[:count]


class _CountingMode(TorchDispatchMode):
    """Counts the storages each op creates on the compute device to the thread's account."""

    def __init__(self, account: Account, operation: str) -> None:
        super().__init__()
        self.account = account
        self.operation = operation

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _thread.suspended:
            return out
        fresh = _fresh(func)
        if not any(fresh):
            return out
        new: list[torch.Tensor] = []
        if len(fresh) == 1:
            _tensors_in(out, new)
        elif isinstance(out, (list, tuple)):
            for is_fresh, value in zip(fresh, out, strict=False):
                if is_fresh:
                    _tensors_in(value, new)
        error = None
        for tensor in new:
            error = self._count(tensor, func) or error
        if error is not None:
            # Freed before raising (the traceback keeps this frame): the refused memory goes;
            # and the frame lets go of the error, or the two would keep each other (and every
            # frame of the traceback, with the activations they hold) until a garbage collection.
            del out, new, tensor
            try:
                raise error
            finally:
                error = None
        return out

    def _count(self, tensor: torch.Tensor, func: Any) -> DeviceBudgetExceeded | None:
        if type(tensor) is not torch.Tensor or tensor.device != self.account.device:
            return None  # a tensor subclass (fake, functional) or another device: no memory here
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or getattr(storage, "_protrain_counted", False):
            return None
        storage._protrain_counted = True  # type: ignore[attr-defined]
        key = id(storage)
        finalizer = weakref.finalize(storage, _release, self.account, nbytes, key)
        finalizer.atexit = False
        operation = f"{self.operation} ({func})"
        if _trace:
            _traced[key] = (nbytes, f"{self.account.label}: {_allocation_site(operation)}")
        error = self.account.add(nbytes, operation)
        if error is not None and _trace:
            held = "; ".join(f"{n:,} bytes by {site}" for n, site in largest_live(self.account))
            error.args = (f"{error.args[0]}; the largest held: {held}",)
        return error


def _tensors_in(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        found.extend(item for item in value if isinstance(item, torch.Tensor))


def _can_count(account: Account | None) -> bool:
    return account is not None and account.device.type == "cpu" and not account.closed


@contextlib.contextmanager
def engine_call(account: Account | None, operation: str) -> Iterator[None]:
    """Count what this thread allocates on the device to ``account`` while the block runs
    (``operation`` names it in the error). Nested calls keep one mode per thread: the innermost
    call's account and name apply."""
    if not _can_count(account):
        yield
        return
    assert account is not None
    mode = _thread.mode
    if mode is not None:
        saved = (mode.account, mode.operation)
        mode.account, mode.operation = account, operation
        try:
            yield
        finally:
            mode.account, mode.operation = saved
        return
    mode = _CountingMode(account, operation)
    _thread.mode = mode
    try:
        with mode:
            yield
    finally:
        _thread.mode = None


def counting_account() -> Account | None:
    """The account this thread's device allocations count to now, if any (CPU, wall up)."""
    mode = _thread.mode
    return None if mode is None else mode.account


def current_call() -> tuple[Account, str] | None:
    """The account and operation this thread counts to now (a side stream made here inherits it)."""
    mode = _thread.mode
    if mode is None or _thread.suspended:
        return None
    return mode.account, mode.operation


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """What this thread allocates in the block is host memory (staging for a save, a chunk
    assembled before it goes to the device): not counted. On a GPU it is host memory by its
    device; on CPU only this says so. Keep the block to the host allocations themselves."""
    _thread.suspended += 1
    try:
        yield
    finally:
        _thread.suspended -= 1


def counted_bytes(account: Account | None) -> int:
    """Bytes counted to ``account`` and still alive (0 when the wall is down)."""
    return 0 if account is None else account.live_bytes

"""A chunk's residency: one state and a table of allowed moves; an illegal move raises.

    PERSISTENT            always on the device (the first n_persist chunks)
    HOST ──fetch──▶ FETCHING ──arrived──▶ RESIDENT ──evict──▶ HOST
                                                       (non-persistent chunks pass through buffers)

runtime/chunks/residency.py schedules the moves.
"""

from __future__ import annotations

from enum import Enum


class Residency(str, Enum):
    PERSISTENT = "persistent"
    HOST = "host"
    FETCHING = "fetching"
    RESIDENT = "resident"


ALLOWED_MOVES: dict[Residency, frozenset[Residency]] = {
    Residency.PERSISTENT: frozenset(),
    Residency.HOST: frozenset({Residency.FETCHING}),
    Residency.FETCHING: frozenset({Residency.RESIDENT}),
    Residency.RESIDENT: frozenset({Residency.HOST}),
}


class IllegalTransition(RuntimeError):
    pass


def check_move(chunk_index: int, current: Residency, target: Residency) -> Residency:
    """``target`` when the move is allowed; IllegalTransition naming the chunk otherwise."""
    if target not in ALLOWED_MOVES[current]:
        raise IllegalTransition(f"chunk {chunk_index}: {current.value} -> {target.value} is not allowed")
    return target

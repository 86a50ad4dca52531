"""A chunk's residency: one state and a table of allowed moves; an illegal move raises.

    PERSISTENT            always on the device (the first n_persist chunks)
    HOST ──gather──▶ RESIDENT ──evict──▶ HOST      (non-persistent chunks pass through buffers)

A RESIDENT chunk occupies one of the n_buffer device slots and its parameters point into it; a
HOST chunk's parameters are shrunk to size 0, so a stray read fails instead of reading another
chunk's data.
"""

from __future__ import annotations

from enum import Enum


class Residency(str, Enum):
    PERSISTENT = "persistent"
    HOST = "host"
    RESIDENT = "resident"


ALLOWED_MOVES: dict[Residency, frozenset[Residency]] = {
    Residency.PERSISTENT: frozenset(),
    Residency.HOST: frozenset({Residency.RESIDENT}),
    Residency.RESIDENT: frozenset({Residency.HOST}),
}


class IllegalTransition(RuntimeError):
    pass


def check_move(chunk_index: int, current: Residency, target: Residency) -> Residency:
    """``target`` when the move is allowed; IllegalTransition naming the chunk otherwise."""
    if target not in ALLOWED_MOVES[current]:
        raise IllegalTransition(f"chunk {chunk_index}: {current.value} -> {target.value} is not allowed")
    return target

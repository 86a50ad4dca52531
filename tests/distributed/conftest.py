from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.distributed.pool import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    pool = RankPool()
    yield pool
    pool.shutdown()

"""What the NVMe tier of optimizer state (``n_optimizer``) saves in host memory and costs in
writes, for the search (profiler/search.py) and the plan table.

Host memory does not fall by a chunk's state for each chunk moved: the first few moved add
their host slots (up to three shards of state, profiler/host_bytes.py), so the saving is taken
from the cost model's own count at every ``n_optimizer``, and the fewest chunks that save enough
found over its running minimum.
"""

from __future__ import annotations

import bisect

from protrain.profiler.chunk_costs import ChunkCosts
from protrain.profiler.cost_model import offloaded_host_bytes

SECONDS_PER_DAY = 86_400


class NvmeHosts:
    """Host bytes of the chunks past ``n_persist`` with 0, 1, ... of the trainable ones' state on
    NVMe (rank 0's, as the cost model counts them)."""

    def __init__(self, costs: ChunkCosts, n_persist: int, *, keeps_gradients: bool) -> None:
        n = costs.num_chunks
        offloaded = costs.trainable_chunks[n] - costs.trainable_chunks[n_persist] if n_persist < n else 0
        self.host = [
            offloaded_host_bytes(costs, n_persist, keeps_gradients=keeps_gradients, n_optimizer=k)
            for k in range(offloaded + 1)
        ]
        # The lowest host figure reached with at most k chunks moved (non-increasing), negated
        # for bisect (which wants ascending keys).
        lowest: list[int] = []
        for value in self.host:
            lowest.append(min(value, lowest[-1]) if lowest else value)
        self._negated_lowest = [-value for value in lowest]

    def fewest_saving(self, nbytes: int) -> int | None:
        """The fewest NVMe chunks whose host figure is at least ``nbytes`` below none's (None:
        moving all of them does not save that much)."""
        target = self.host[0] - nbytes
        k = bisect.bisect_left(self._negated_lowest, -target)
        return k if k < len(self.host) else None


def writes_per_day(write_bytes_per_update: int, step_s: float) -> float:
    """Bytes an update's writes come to over a day of back-to-back updates of ``step_s``."""
    return write_bytes_per_update * SECONDS_PER_DAY / step_s if step_s > 0 else 0.0

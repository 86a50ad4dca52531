"""Two engines alive at once on two real gloo ranks. Every chunk is offloaded in both, so each
engine issues all-gathers and reduce-scatters from its own side-stream thread while the other
does the same: on one shared process group the ranks could pair one engine's collective with
the other's. Each engine has its own group; both train interleaved like plain PyTorch, and the
second trains on after the first is closed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.distributed.pool import RankPool
from tests.helpers import (
    assert_matches_reference,
    assert_state_equal,
    gpt_reference,
    lm_batches,
    tiny_gpt,
    train_updates,
)

LR = 1e-3


def _config(output_dir: str) -> dict[str, Any]:
    return {
        "seed": 3,
        "micro_batch_size": 2,
        "optimizer": {"lr": LR, "weight_decay": 0.1},
        "output_dir": output_dir,
        "memory": {"device_budget": "256MiB", "chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2},
    }


def _delay_side_stream(engine: Any, *, seconds: float) -> None:
    stream = engine.chunks.stream
    submit = stream.submit

    def delayed(work: Callable[[], None]) -> Any:
        def late() -> None:
            time.sleep(seconds)
            work()

        return submit(late)

    stream.submit = delayed


def two_engines(*, rank: int, output_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from protrain import runtime

    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("protrain"))
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=2)
    teacher = runtime.initialize(tiny_gpt(0), config=_config(output_dir))
    student = runtime.initialize(tiny_gpt(1), config=_config(output_dir))
    # One engine's side-stream work is late on each rank (the teacher's on rank 1, the student's
    # on rank 0), so the two engines' collectives are issued in opposite orders on the two
    # ranks: on one shared group they would pair up wrongly; on their own groups nothing changes.
    _delay_side_stream(teacher if rank == 1 else student, seconds=0.02)
    # Each engine trained from its own thread, as an actor and a critic may be: their collectives
    # interleave in whatever order the threads reach them, differently on each rank.
    workers = [
        threading.Thread(target=train_updates, args=(engine, data, range(3)), kwargs={"rank": rank})
        for engine in (teacher, student)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    teacher_state = teacher.state_dict()
    teacher.close()
    train_updates(student, data, range(3, 5), rank=rank)
    student_state = student.state_dict()
    student.close()
    dist.barrier()  # the pool's own default group survived both engines
    return {
        "teacher": teacher_state,
        "student": student_state,
        "threads_left": sorted(t.name for t in threading.enumerate() if t.name.startswith("protrain")) != threads,
    }


def test_two_engines_on_two_ranks_train_interleaved_like_plain_pytorch(rank_pool: RankPool, tmp_path: Path) -> None:
    results = rank_pool.run(two_engines, output_dir=str(tmp_path))
    teacher = gpt_reference(seed=0, world_size=2, steps=3, lr=LR, weight_decay=0.1)
    student = gpt_reference(seed=1, world_size=2, steps=5, lr=LR, weight_decay=0.1)
    for name, expected in (("teacher", teacher), ("student", student)):
        assert_state_equal(results[1][name], results[0][name])
        assert_matches_reference(results[0][name], expected.fp32, expected.fp64)
    assert not any(result["threads_left"] for result in results)

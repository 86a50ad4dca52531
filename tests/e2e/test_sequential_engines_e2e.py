"""Engines one after another in the same two ranks of a real protrain-run launch (train then
evaluate, a sweep, Trainer after Trainer): the process group ProTrain created for the first
stays usable for the next, and each engine trains like plain PyTorch."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.e2e.conftest import Job
from tests.helpers import assert_matches_reference, gpt_reference

ENGINES = 3
UPDATES = 2

SEQUENTIAL_SCRIPT = f"""\
from pathlib import Path
import torch
from protrain import runtime
from tests.helpers import lm_batches, tiny_gpt, train_updates

config = runtime.current_spec().model_dump(mode="json")
config["memory"].update(chunk_size="64KiB", n_persist=0, n_buffer=2)  # every collective in use
config["optimizer"].update(lr=1e-3, weight_decay=0.1)
for number in range({ENGINES}):
    engine = runtime.initialize(tiny_gpt(number), config=config)
    data = lm_batches(micro_batch_size=2, accumulation=1, world_size=engine.world_size)
    train_updates(engine, data, range({UPDATES}), rank=engine.rank)
    state = engine.state_dict()
    if engine.rank == 0:
        torch.save(state, f"engine{{number}}.pt")
    engine.close()
Path(f"rank{{engine.rank}}.done").write_text("ok")
"""


def test_three_engines_one_after_another_on_two_ranks_each_train_like_plain_pytorch(job: Job) -> None:
    job.script.write_text(SEQUENTIAL_SCRIPT)
    result = job.run("--nproc-per-node", "2", str(job.script), "--config", str(job.spec), timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for rank in (0, 1):
        assert (Path(job.workdir) / f"rank{rank}.done").read_text() == "ok"
    for number in range(ENGINES):
        reference = gpt_reference(seed=number, world_size=2, steps=UPDATES, lr=1e-3, weight_decay=0.1)
        trained = torch.load(Path(job.workdir) / f"engine{number}.pt", weights_only=True)
        assert_matches_reference(trained, reference.fp32, reference.fp64)

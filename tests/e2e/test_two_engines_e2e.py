"""Two engines in each rank of a real protrain-run launch: the first engine creates the process
group, and closing it must not take the group from the second, which trains on and closes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import Job

TWO_ENGINES_SCRIPT = """\
from pathlib import Path
import torch
from protrain import runtime
from protrain_demo.corpus import LMBatches, stdlib_text_corpus
from protrain_demo.gpt import GPT, PRESETS

# The launcher's spec with a device budget set by hand: 64 MiB each, well under the machine.
config = runtime.current_spec().model_dump(mode="json")
config["memory"]["device_budget"] = "64MiB"
torch.manual_seed(1)
teacher = runtime.initialize(GPT(PRESETS["tiny"]), config=config)
student = runtime.initialize(GPT(PRESETS["tiny"]), config=config)
rank = teacher.rank
data = LMBatches(tokens=stdlib_text_corpus(), seq_len=32, micro_batch_size=2, gradient_accumulation_steps=1,
                 world_size=teacher.world_size, seed=1)
for update in range(2):
    for engine in (teacher, student):
        out = engine(**data.batch(update, 0, rank))
        engine.backward(out.loss)
        engine.step()
teacher.close()
for update in range(2, 4):
    out = student(**data.batch(update, 0, rank))
    student.backward(out.loss)
    student.step()
Path(f"rank{rank}.done").write_text(f"{teacher.global_step} {student.global_step}")
student.close()
"""


def test_closing_the_engine_that_made_the_process_group_leaves_the_other_training(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under the device wall each engine's device tier is its own count: the C heap, which the
    # CPU reads otherwise, is the process's, and the student's profile took the teacher's (and
    # gloo's) allocations for its own transient peak (runtime/hw/device_wall.py).
    monkeypatch.setenv("PROTRAIN_STRICT_DEVICE", "1")
    job.script.write_text(TWO_ENGINES_SCRIPT)
    result = job.run("--nproc-per-node", "2", str(job.script), "--config", str(job.spec), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert (Path(job.workdir) / f"rank{rank}.done").read_text() == "2 4"
    assert "Traceback" not in result.stderr

"""``protrain-run --dry-run`` holds however a script passes its spec: a path, a dict or a ``Spec``
to ``runtime.initialize``, or a ``protrain=`` spec to ``ProTrainTrainer`` (and TRL's trainers
through the mixin). Each plans, prints the plan table a real run prints, and ends the process
with exit 0 before any training step, writing nothing (before: a spec passed by the script
trained for real under --dry-run, checkpoints and all).

The launcher's part, handing the ranks a resolved spec marked a dry run in ``PROTRAIN_SPEC``, is
set up here as it sets it up (tests/e2e/test_launcher.py runs it for real)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from protrain import runtime
from protrain.runtime.config.spec_io import RESOLVED_SPEC_ENV, ResolvedSpec, load_spec, write_resolved
from protrain_demo.gpt import GPT, GPTConfig
from tests.helpers import lm_batches
from tests.hf_trainer_runs import CausalWindows, tiny_model

SMALL = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
SPEC = """\
seed: 1
micro_batch_size: 2
optimizer: {lr: 1.0e-3}
memory: {chunk_size: 64KiB, n_persist: 1, n_buffer: 2}
output_dir: runs
"""


@pytest.fixture
def launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder with job.yaml, as ``protrain-run --dry-run`` would
    hand it to the script (the folder is the script's working directory)."""
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(SPEC)
    handed = tmp_path.parent / f"{tmp_path.name}-launch" / "spec.json"
    handed.parent.mkdir()
    write_resolved(ResolvedSpec.of(load_spec(spec_file), source=str(spec_file), dry_run=True, world_size=1), handed)
    monkeypatch.setenv(RESOLVED_SPEC_ENV, str(handed))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def table_rows(text: str) -> list[str]:
    """The plan table's rows: knob and origin, and the value of what the spec or the launch set
    (the rest comes from measurements, of the machine's free memory or of the profiling step's
    times, which move between two runs)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 3 and cells[0] and cells[0] != "knob":
            given = cells[2] in ("spec", "launch")
            rows.append(" ".join(cells) if given else f"{cells[0]} {cells[2]}")
    return rows


def dry_run_output(capsys: pytest.CaptureFixture[str], entry: Any) -> str:
    with pytest.raises(SystemExit) as ended:
        entry()
    out = capsys.readouterr().out
    assert ended.value.code == 0, out
    assert "dry run: no process group, no training step" in out
    assert "Plan for 1 rank(s)" in out
    return out


@pytest.mark.parametrize("how", ["path", "dict", "Spec"])
def test_a_spec_the_script_passes_to_initialize_is_a_dry_run(
    launched: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    before = files(launched)
    config: Any = {
        "path": "job.yaml",
        "dict": yaml.safe_load(SPEC),
        "Spec": load_spec(launched / "job.yaml"),
    }[how]
    out = dry_run_output(capsys, lambda: runtime.initialize(GPT(SMALL), config=config, example_batch=batch()))
    assert files(launched) == before, "a dry run writes nothing"
    # The table a real run prints, row for row.
    real_rows = table_rows(real_run_table(launched, capsys))
    assert table_rows(out) == real_rows and len(real_rows) > 10


def real_run_table(folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    import os

    os.environ.pop(RESOLVED_SPEC_ENV)
    with runtime.initialize(GPT(SMALL), config="job.yaml", example_batch=batch()):
        pass
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "ProTrain plan")
    return "\n".join(lines[start:])


def batch() -> Any:
    """The example batch both runs plan on (a real run settles its plan on it at initialize)."""
    return lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)


def trainer_args(folder: Path) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(folder / "out"),
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        per_device_train_batch_size=2,
        max_steps=6,
        save_steps=3,
        weight_decay=0.0,
    )


def test_a_trainer_with_its_own_spec_is_a_dry_run_and_makes_no_output_folder(
    launched: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from protrain.runtime.integrations.hf import ProTrainTrainer

    before = files(launched)
    spec = yaml.safe_load(SPEC)
    spec.pop("micro_batch_size")  # the Trainer's per_device_train_batch_size gives it
    out = dry_run_output(
        capsys,
        lambda: ProTrainTrainer(
            model=tiny_model("llama"), args=trainer_args(launched), train_dataset=CausalWindows(16), protrain=spec
        ),
    )
    assert re.search(r"n_persist\s*│\s*1", out)
    assert files(launched) == before, "no output folder, no checkpoint"


def test_trls_trainer_through_the_mixin_is_a_dry_run(launched: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("trl")
    from tests.unit.test_hf_trainer_trl import ProTrainSFT, sft

    before = files(launched)
    dry_run_output(capsys, lambda: sft(ProTrainSFT, launched / "out", gradient_checkpointing=False))
    assert files(launched) == before

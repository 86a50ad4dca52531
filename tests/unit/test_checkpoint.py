"""Checkpoints on one rank, as a user meets them: a run stopped and resumed ends exactly where the
uninterrupted run ends; the directory holds complete checkpoints only, the newest named by
``latest`` and no more than ``keep_last``; broken checkpoints give errors that say what is wrong;
a kill during a save, a failing save and Ctrl-C lose nothing committed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from protrain import runtime
from protrain.runtime.checkpoint.store import CheckpointError
from tests.checkpointing import DROPOUT_GPT, Windows, checkpoint_job, checkpoint_tensors, train_until
from tests.helpers import assert_state_equal, tiny_gpt

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def step_dirs(root: Path) -> list[str]:
    return sorted(entry.name for entry in root.iterdir())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("uninterrupted")
    return train_until(checkpoint_job(str(root)), until=6)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_stopped_and_resumed_run_ends_bit_identical(
    tmp_path: Path, uninterrupted: dict[str, Any], async_save: bool
) -> None:
    first = train_until(
        checkpoint_job(str(tmp_path), checkpoint={"interval_steps": 3, "async_save": async_save}), until=4
    )
    assert first["offloaded_chunks"] > 0  # the CPU-Adam path is what gets checkpointed
    # The run went on past the save (update 4): resume takes update 3's state, not the live one.
    second = train_until(checkpoint_job(str(tmp_path)), until=6)
    assert second["started_at"] == 3 and second["resumed_from"].endswith("step-00000003")
    assert first["losses"][:3] + second["losses"] == uninterrupted["losses"]
    assert_state_equal(second["state"], uninterrupted["state"])


def test_resume_with_activations_on_ssd_and_recomputed_matches_the_plain_run(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    activations = {"block_modes": ["ssd", "checkpoint"], "ssd": {"path": str(tmp_path / "ssd")}}
    first = train_until(
        checkpoint_job(str(tmp_path), checkpoint={"interval_steps": 3}, memory=activations), until=3
    )
    second = train_until(checkpoint_job(str(tmp_path), memory=activations), until=6)
    assert second["started_at"] == 3
    # Activation modes change where activations live, never the math: equal to all-kept.
    assert first["losses"] + second["losses"] == uninterrupted["losses"]
    assert_state_equal(second["state"], uninterrupted["state"])
    assert list((tmp_path / "ssd").iterdir()) == []


def test_directory_holds_keep_last_complete_checkpoints_and_latest(tmp_path: Path) -> None:
    train_until(checkpoint_job(str(tmp_path), checkpoint={"interval_steps": 1, "keep_last": 2}), until=5)
    root = tmp_path / "ckpt"
    assert step_dirs(root) == ["latest", "step-00000004", "step-00000005"]
    assert (root / "latest").read_text() == "step-00000005\n"
    manifest = json.loads((root / "step-00000005" / "protrain.json").read_text())
    assert manifest["global_step"] == 5 and manifest["world_size"] == 1
    assert manifest["data"] == {"num_samples": 96, "seed": 5, "shuffle": True, "epoch": 0, "offset": 20}
    listed = set(manifest["files"])
    assert listed == {p.name for p in (root / "step-00000005").iterdir()} - {"protrain.json"}
    # Saved in parameter space: each parameter and its Adam moments under the model's own names.
    tensors = checkpoint_tensors(str(root / "step-00000005"))
    model = tiny_gpt(0, DROPOUT_GPT)
    for name, param in model.named_parameters():
        for prefix in ("model.", "optim.exp_avg.", "optim.exp_avg_sq."):
            assert tensors[prefix + name].shape == param.shape
        assert float(tensors["optim.step." + name]) == 5.0


def test_resume_never_and_an_explicit_path(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    train_until(checkpoint_job(str(tmp_path), checkpoint={"interval_steps": 2}), until=4)
    fresh = train_until(checkpoint_job(str(tmp_path), checkpoint={"resume": "never"}), until=1)
    assert fresh["started_at"] == 0 and fresh["resumed_from"] is None
    chosen = tmp_path / "ckpt" / "step-00000002"
    resumed = train_until(
        checkpoint_job(str(tmp_path / "elsewhere"), checkpoint={"resume": str(chosen)}), until=6
    )
    assert resumed["started_at"] == 2
    assert_state_equal(resumed["state"], uninterrupted["state"])


def _save_one(tmp_path: Path) -> Path:
    train_until(checkpoint_job(str(tmp_path), checkpoint={"interval_steps": 1}), until=1)
    return tmp_path / "ckpt" / "step-00000001"


def _resume_error(tmp_path: Path, path: Path, model: torch.nn.Module | None = None) -> str:
    config = checkpoint_job(str(tmp_path / "other"), checkpoint={"resume": str(path)})
    if model is not None:
        config["memory"] = {}  # its own plan: the layout differs, the names and shapes are checked
    with pytest.raises(CheckpointError) as caught:
        runtime.initialize(model or tiny_gpt(0, DROPOUT_GPT), config=config)
    return str(caught.value)


def test_broken_checkpoints_are_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    path = _save_one(tmp_path)
    data_file = path / "__0_0.distcp"
    original = data_file.read_bytes()

    data_file.write_bytes(original[: len(original) // 2])
    message = _resume_error(tmp_path, path)
    assert str(path) in message and "__0_0.distcp is" in message and "the manifest says" in message

    data_file.unlink()
    assert "__0_0.distcp is missing" in _resume_error(tmp_path, path)
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
    data_file.write_bytes(bytes(flipped))
    message = _resume_error(tmp_path, path)
    assert "corrupt checkpoint: __0_0.distcp changed since it was saved (CRC-32 mismatch)" in message
    data_file.write_bytes(original)

    metadata = path / ".metadata"
    metadata.write_bytes(b"\0" * metadata.stat().st_size)  # same size, garbage
    assert ".metadata changed since it was saved (CRC-32 mismatch)" in _resume_error(tmp_path, path)
    # A checkpoint recorded without checksums: DCP's own reading of the metadata fails.
    manifest = json.loads((path / "protrain.json").read_text())
    del manifest["checksums"]
    (path / "protrain.json").write_text(json.dumps(manifest))
    assert "corrupt checkpoint metadata" in _resume_error(tmp_path, path)

    (path / "protrain.json").unlink()
    assert "incomplete checkpoint: protrain.json is missing" in _resume_error(tmp_path, path)

    assert "no such checkpoint" in _resume_error(tmp_path, tmp_path / "nowhere")


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    path = _save_one(tmp_path)
    import dataclasses

    wider = tiny_gpt(0, dataclasses.replace(DROPOUT_GPT, d_model=128))
    message = _resume_error(tmp_path, path, wider)
    assert (
        "does not match this model" in message
        and "blocks.0.ln_1.bias has shape (64,), the model (128,)" in message
    )


def test_a_failing_save_keeps_the_previous_checkpoint_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_until(checkpoint_job(str(tmp_path), checkpoint={"interval_steps": 2}), until=2)
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def disk_full(state_dict: Any, **kwargs: Any) -> Any:
        real_save(state_dict, **kwargs)  # the files are written, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint .* is intact"):
        train_until(checkpoint_job(str(tmp_path), checkpoint={"interval_steps": 2}), until=4)
    root = tmp_path / "ckpt"
    assert step_dirs(root) == ["latest", "step-00000002"]
    assert (root / "latest").read_text() == "step-00000002\n"


KILLED_DURING_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import protrain.runtime.checkpoint.store as store
from tests.checkpointing import checkpoint_job, train_until

real = store.write_manifest
def die_on_second(directory, content):
    if content["global_step"] == 4:
        os.kill(os.getpid(), signal.SIGKILL)  # after the tensor files, before the manifest
    real(directory, content)
store.write_manifest = die_on_second
import protrain.runtime.checkpoint.checkpointer as checkpointer
checkpointer.write_manifest = die_on_second
train_until(checkpoint_job({workdir!r}, checkpoint={{"interval_steps": 2}}), until=6)
"""


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_DURING_SAVE.format(root=str(ROOT), workdir=str(tmp_path))))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    root = tmp_path / "ckpt"
    assert step_dirs(root) == [".tmp-step-00000004", "latest", "step-00000002"]
    resumed = train_until(checkpoint_job(str(tmp_path), checkpoint={"interval_steps": 2}), until=4)
    assert resumed["started_at"] == 2
    # The next save cleared what the killed one left behind.
    assert step_dirs(root) == ["latest", "step-00000002", "step-00000004"]


INTERRUPTED = """
import sys, time
sys.path.insert(0, {root!r})
import torch
from protrain import runtime
from tests.checkpointing import DROPOUT_GPT, Windows, checkpoint_job
from tests.helpers import tiny_gpt

torch.manual_seed(0)
engine = runtime.initialize(tiny_gpt(0, DROPOUT_GPT), config=checkpoint_job({workdir!r}))
for batch in engine.data_loader(Windows()):
    out = engine(**batch)
    if engine.global_step == 2:
        print("ready", flush=True)
        time.sleep({pause})  # the signal lands here, inside update 3
    engine.backward(out.loss)
    engine.step()
"""


def start_interrupted(tmp_path: Path, pause: float) -> subprocess.Popen[str]:
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED.format(root=str(ROOT), workdir=str(tmp_path), pause=pause))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    proc.kill()
    raise AssertionError(f"the script ended early: {proc.communicate()[1][-2000:]}")


def test_ctrl_c_saves_a_checkpoint_and_exits_130_then_resume_continues(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    proc = start_interrupted(tmp_path, pause=1.0)
    try:
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "stopping at the end of this step" in stderr and "stopped at update 3" in stdout
    assert "Traceback" not in stderr
    # The window in flight completed, then its checkpoint: resuming finishes like the full run.
    assert step_dirs(tmp_path / "ckpt") == ["latest", "step-00000003"]
    resumed = train_until(checkpoint_job(str(tmp_path)), until=6)
    assert resumed["started_at"] == 3
    assert_state_equal(resumed["state"], uninterrupted["state"])


def test_a_second_ctrl_c_aborts_at_once(tmp_path: Path) -> None:
    proc = start_interrupted(tmp_path, pause=60)
    try:
        proc.send_signal(signal.SIGINT)  # a stop request: it would wait for the step's end
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)  # far less than the step's 60 s pause
    finally:
        proc.kill()
    assert proc.returncode in (-signal.SIGINT, 130) and "KeyboardInterrupt" in stderr
    assert not (tmp_path / "ckpt").exists()


def fake_checkpoint(directory: Path, step: int) -> None:
    from protrain.runtime.checkpoint.store import write_manifest

    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(b"x" * step)
    write_manifest(directory, {"global_step": step})


def test_a_crash_between_the_renames_of_a_resave_is_repaired(tmp_path: Path) -> None:
    """Saving step 4 again moves the old step-00000004 aside before the new one takes its name;
    a crash in between leaves both under temporary names: the next look at the root puts the
    complete new one back (a save, or a resume)."""
    from protrain.runtime.checkpoint.store import latest_checkpoint, publish, recover, remove_stale_temps

    root = tmp_path / "ckpt"
    fake_checkpoint(root / ".tmp-step-00000004", 4)
    publish(root / ".tmp-step-00000004", root / "step-00000004")
    fake_checkpoint(root / ".tmp-step-00000004", 44)  # the second save of step 4, complete
    os.replace(root / "step-00000004", root / ".tmp-old-step-00000004")  # ... then the crash
    assert latest_checkpoint(root) is None
    assert recover(root) == [root / "step-00000004"]
    found = latest_checkpoint(root)
    assert found is not None and (found.path / "__0_0.distcp").stat().st_size == 44
    remove_stale_temps(root)
    assert step_dirs(root) == ["latest", "step-00000004"]
    # Only the old copy survived (the new one was incomplete): it gets its name back.
    fake_checkpoint(root / ".tmp-step-00000006", 6)
    publish(root / ".tmp-step-00000006", root / "step-00000006")
    os.replace(root / "step-00000006", root / ".tmp-old-step-00000006")
    (root / ".tmp-step-00000006").mkdir()
    remove_stale_temps(root)
    assert step_dirs(root) == ["latest", "step-00000004", "step-00000006"]


def frozen_embedding_run(tmp_path: Path, seed: int, until: int) -> torch.Tensor:
    """Position embeddings frozen and every chunk persistent; the eval logits of one batch."""
    model = tiny_gpt(seed)
    model.wpe.weight.requires_grad_(False)
    config = checkpoint_job(
        str(tmp_path), memory={"chunk_size": "auto", "n_persist": "auto", "n_buffer": "auto"}
    )
    config["checkpoint"]["interval_steps"] = 1
    with runtime.initialize(model, config=config) as engine:
        loader = iter(engine.data_loader(Windows()))
        while engine.global_step < until:
            out = engine(**next(loader))
            engine.backward(out.loss)
            engine.step()
        engine.eval()
        with torch.no_grad():
            return engine(**Windows().first_batch(2)).logits.clone()


def test_frozen_persistent_weights_are_reloaded_too(tmp_path: Path) -> None:
    saved = frozen_embedding_run(tmp_path, seed=0, until=2)
    # Another initialisation of the frozen embedding: the checkpoint's values must replace it.
    resumed = frozen_embedding_run(tmp_path, seed=1, until=2)
    assert torch.equal(resumed, saved)


AFTER_THE_LOOP = """
import os, signal, sys
sys.path.insert(0, {root!r})
from protrain import runtime
from tests.checkpointing import Windows, checkpoint_job
from tests.helpers import tiny_gpt

engine = runtime.initialize(tiny_gpt(0), config=checkpoint_job({workdir!r}))
loader = iter(engine.data_loader(Windows()))
for _ in range(2 * engine.gradient_accumulation_steps):
    out = engine(**next(loader))
    engine.backward(out.loss)
    engine.step()
os.kill(os.getpid(), signal.SIGTERM)  # no update under way: nothing to wait for
print("still running", flush=True)
engine.close()
print("not reached", flush=True)
"""


def test_a_stop_between_updates_ends_the_run_at_close(tmp_path: Path) -> None:
    script = tmp_path / "after.py"
    script.write_text(AFTER_THE_LOOP.format(root=str(ROOT), workdir=str(tmp_path)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert "still running" in proc.stdout and "stopped after update 2 (SIGTERM)" in proc.stdout
    assert "not reached" not in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.skips_steps
def test_fp16_loss_scale_and_skipped_updates_are_resumed(tmp_path: Path) -> None:
    """fp16: the dynamic loss scale (and its clean-step count) and the skipped-update count are
    part of the state; a resumed run goes on from them, ending like the uninterrupted run."""
    fp16 = {"precision": "fp16", "loss_scaling": {"initial": 2.0**20, "growth_interval": 2}}
    full = train_until(checkpoint_job(str(tmp_path / "full"), **fp16), until=5)
    train_until(checkpoint_job(str(tmp_path / "cut"), checkpoint={"interval_steps": 3}, **fp16), until=3)
    manifest = json.loads((tmp_path / "cut" / "ckpt" / "step-00000003" / "protrain.json").read_text())
    assert manifest["loss_scaler"]["scale"] < 2.0**20  # the huge first scale overflowed and fell
    resumed = train_until(checkpoint_job(str(tmp_path / "cut"), **fp16), until=5)
    assert resumed["started_at"] == 3
    assert_state_equal(resumed["state"], full["state"])

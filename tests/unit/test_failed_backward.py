"""A backward that fails (a full disk, a failed read, Ctrl-C) and is caught: the window's
partial gradients are dropped, so running the window again trains exactly like an engine that
never failed; early CPU-Adam updates that cannot be undone make the engine refuse to go on
until a checkpoint is loaded, instead of training on half-updated parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from protrain import runtime
from tests.helpers import assert_state_equal, lm_batches, tiny_gpt

DATA = lm_batches(micro_batch_size=2, accumulation=2, world_size=1)


def job(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "seed": 3,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1},
        "output_dir": str(tmp_path / "runs"),
        # Every chunk offloaded: CPU Adam updates chunks early, while backward still runs.
        "memory": {"device_budget": "256MiB", "chunk_size": "64KiB", "n_persist": 0, "n_buffer": 2},
    }
    spec.update(overrides)
    return spec


class FailOnce:
    """A backward hook on a module that raises the first time it fires after ``arm()``."""

    def __init__(self, module: nn.Module) -> None:
        self.armed = False
        module.register_full_backward_hook(self._hook)

    def arm(self) -> None:
        self.armed = True

    def _hook(self, *_args: Any) -> None:
        if self.armed:
            self.armed = False
            raise OSError("a read of saved activations failed")


def window(engine: Any, update: int) -> None:
    for micro in range(2):
        out = engine(**DATA.batch(update, micro, 0))
        engine.backward(out.loss)
        engine.step()


def test_a_caught_backward_failure_drops_the_window_and_the_retry_trains_as_if_none_happened(
    tmp_path: Path,
) -> None:
    reference = runtime.initialize(tiny_gpt(), config=job(tmp_path, gradient_clipping=1.0))
    for update in range(3):
        window(reference, update)
    expected = reference.state_dict()
    reference.close()

    model = tiny_gpt()
    failure = FailOnce(model.blocks[0])
    # Clipping on: early updates keep their snapshots, so even a failure in the window's last
    # backward (after chunks were updated from it) can be undone.
    engine = runtime.initialize(model, config=job(tmp_path, gradient_clipping=1.0))
    window(engine, 0)
    # In the window's first micro-batch:
    out = engine(**DATA.batch(1, 0, 0))
    failure.arm()
    with pytest.raises(OSError, match="a read of saved activations failed"):
        engine.backward(out.loss)
    # In its last one, after the first went through:
    out = engine(**DATA.batch(1, 0, 0))
    engine.backward(out.loss)
    engine.step()
    out = engine(**DATA.batch(1, 1, 0))
    failure.arm()
    with pytest.raises(OSError, match="a read of saved activations failed"):
        engine.backward(out.loss)
    assert engine.global_step == 1 and engine.micro_step == 2
    window(engine, 1)
    window(engine, 2)
    assert_state_equal(engine.state_dict(), expected)
    engine.close()


def test_early_updates_without_undo_state_make_the_engine_refuse_until_a_checkpoint_is_loaded(
    tmp_path: Path,
) -> None:
    model = tiny_gpt()
    failure = FailOnce(model.blocks[0])
    engine = runtime.initialize(model, config=job(tmp_path, checkpoint={"dir": str(tmp_path / "ckpt")}))
    window(engine, 0)
    saved = engine.save_checkpoint()
    out = engine(**DATA.batch(1, 0, 0))
    engine.backward(out.loss)
    engine.step()
    out = engine(**DATA.batch(1, 1, 0))
    failure.arm()  # the last backward of the window: chunks after block 0 are updated early
    with pytest.raises(OSError):
        engine.backward(out.loss)
    with pytest.raises(RuntimeError, match="part-updated: load a checkpoint"):
        engine(**DATA.batch(1, 0, 0))
    engine.load_checkpoint(saved)
    window(engine, 1)
    assert engine.global_step == 2
    engine.close()

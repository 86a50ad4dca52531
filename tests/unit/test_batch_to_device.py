"""The batch goes where the chunks are: ``Engine.forward`` moves every tensor of its arguments
to the engine's device (``runtime.data.batches.to_device``), following dicts, lists and tuples, leaving
everything else the very same object, copying from pinned memory without blocking.

On CPU the engine's device is where the batch already is, so the move itself is shown on the
meta device (each tensor changes device, keeps dtype and shape), and the Engine's use of it with
a spy."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

import protrain.runtime.training.engine
from protrain import runtime
from protrain.runtime.data.batches import to_device
from tests.helpers import lm_batches, tiny_gpt

META = torch.device("meta")
Pair = namedtuple("Pair", ["tensor", "label"])


def test_every_nested_tensor_moves_and_nothing_else_changes() -> None:
    ids, mask, scale = torch.arange(6).view(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.tensor(0.5)
    config, label = object(), "text"
    batch = {
        "input_ids": ids,
        "extra": [mask, (label, 3, None, {"scale": scale})],
        "config": config,
        "pair": Pair(scale, label),
    }
    moved = to_device(batch, META)
    assert isinstance(moved["extra"], list) and isinstance(moved["extra"][1], tuple)
    assert type(moved["pair"]) is Pair
    tensors = [
        (moved["input_ids"], ids),
        (moved["extra"][0], mask),
        (moved["extra"][1][3]["scale"], scale),
        (moved["pair"].tensor, scale),
    ]
    for got, source in tensors:
        assert got.device == META and got.dtype == source.dtype and got.shape == source.shape
        assert source.device.type == "cpu"  # moved, not changed in place
    assert moved["config"] is config
    assert moved["extra"][1][0] is label and moved["extra"][1][1] == 3 and moved["extra"][1][2] is None
    assert moved["pair"].label is label


def test_a_tensor_already_there_is_returned_as_is() -> None:
    ids = torch.arange(4)
    assert to_device([ids], ids.device)[0] is ids


def test_pinned_tensors_are_copied_without_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU build cannot pin: the one tensor says it is pinned, and the copies are watched."""
    pinned, plain = torch.zeros(3), torch.zeros(3)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self is pinned)
    copies: list[bool] = []
    move = torch.Tensor.to

    def watched(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copies.append(bool(kwargs.get("non_blocking", False)))
        return move(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", watched)
    to_device({"a": pinned, "b": [plain]}, META)
    assert copies == [True, False]


def test_engine_forward_moves_the_batch_to_its_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every forward passes its arguments through ``to_device`` with the engine's device, and the
    model runs on what came back (keyword arguments in training, positional ones in eval)."""
    model = tiny_gpt()
    engine = runtime.initialize(model, config={"seed": 1, "micro_batch_size": 2, "output_dir": str(tmp_path)})
    calls: list[tuple[Any, torch.device, Any]] = []

    def spy(batch: Any, device: torch.device) -> Any:
        moved = to_device(batch, device)
        calls.append((batch, device, moved))
        return moved

    monkeypatch.setattr(protrain.runtime.training.engine, "to_device", spy)
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)
    with engine:
        engine.backward(engine(**batch).loss)
        engine.step()
        engine.eval()
        with torch.no_grad():
            engine(batch["input_ids"])
    assert len(calls) == 2
    assert [device for _, device, _ in calls] == [engine.device_info.device] * 2
    (train, _, (_, moved_kwargs)), (evaluate, _, (moved_args, _)) = calls
    assert train[0] == () and all(train[1][key] is batch[key] for key in batch)
    assert evaluate[0] == (batch["input_ids"],)
    # The model's own forward got what to_device returned.
    assert seen[-2][1]["input_ids"] is moved_kwargs["input_ids"]
    assert seen[-1][0][0] is moved_args[0]


def _transfer(batch: Any, device: torch.device) -> Any:
    """What a move to another device gives: new tensors, equal values (on CPU, clones)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {key: _transfer(value, device) for key, value in batch.items()}
    return batch


def test_planning_forwards_read_the_example_batch_where_the_model_computes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host batch given to ``initialize(example_batch=...)`` or ``plan_on_batch`` is moved to the
    engine's device before any planning forward reads it (a GPU run with a loader's host batch
    failed in the embedding: index on cpu, weights on cuda:0)."""
    import protrain.runtime.entry
    from protrain.runtime.planning.profilers import Profilers

    moves: list[tuple[torch.device, Any]] = []

    def spy(batch: Any, device: torch.device) -> Any:
        moved = _transfer(batch, device)
        moves.append((device, moved))
        return moved

    monkeypatch.setattr(protrain.runtime.entry, "to_device", spy)
    monkeypatch.setattr(protrain.runtime.training.engine, "to_device", spy)
    model = tiny_gpt()
    read: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda _, args, kwargs: read.append(kwargs["input_ids"]), with_kwargs=True)
    batch = lm_batches(micro_batch_size=2, accumulation=1, world_size=1).batch(0, 0, 0)
    spec = {"seed": 1, "micro_batch_size": 2, "output_dir": str(tmp_path)}
    # As on a GPU: the model is in host memory, so it is planned on the batch through its chunks.
    as_on_gpu = Profilers(holds_model=lambda model, device: False)
    with runtime.initialize(model, config=spec, example_batch=batch, profilers=as_on_gpu) as engine:
        assert read, "initialize planned without a forward on the example batch"
        assert moves and all(device == engine.device_info.device for device, _ in moves)
        moved = [m["input_ids"] for _, m in moves]
        assert all(any(ids is m for m in moved) for ids in read), "a planning forward read the host batch"
        moves.clear()
        engine.plan_on_batch(batch)  # planned once already: no forward, but moved all the same
        assert [device for device, _ in moves] == [engine.device_info.device]

"""A batch, as the engine and the planner see it: how the model is called on it, its shape and
size, where its tensors go, and where the loss is in what the model returns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, else ``model(batch)``."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it moved to ``device``, following dicts (any mapping, as a
    dict), lists and tuples (named ones keep their type) to any depth; anything else is returned
    as the very same object. A tensor from pinned host memory is copied with ``non_blocking``:
    the copy is ordered on the compute stream before the forward that reads it."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=batch.device.type == "cpu" and batch.is_pinned())
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def batch_shape(batch: Any) -> tuple[int, ...]:
    """Shape of the batch's main input: ``input_ids`` if present, else its first tensor."""
    if isinstance(batch, dict):
        first = batch.get("input_ids")
        candidates = [first] if first is not None else list(batch.values())
    elif isinstance(batch, (tuple, list)):
        candidates = list(batch)
    else:
        candidates = [batch]
    for candidate in candidates:
        if isinstance(candidate, torch.Tensor):
            return tuple(candidate.shape)
    return ()


def refuse_larger_batch(planned: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward's batch larger than the ``planned`` shape (the plan's memory prediction holds
    for batches no larger than the profiled one) raises; no planned shape: anything goes."""
    if not planned:
        return
    shape = batch_shape(kwargs if kwargs else args if len(args) != 1 else args[0])
    if len(shape) == len(planned) and any(got > limit for got, limit in zip(shape, planned, strict=True)):
        raise ValueError(
            f"a batch of shape {tuple(shape)} is larger than the {tuple(planned)} this plan was made "
            "for (its memory prediction would not hold); pass the largest batch the job uses as "
            "initialize(..., example_batch=...) (ProTrainTrainer(..., example_batch=...)), or pad "
            "every batch to one length"
        )


def _batch_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``input_ids`` if given, else the first integer tensor argument, else the first tensor (a
    batch passed as one mapping is looked into)."""
    if not kwargs and len(args) == 1 and isinstance(args[0], dict):
        return _batch_tensor((), args[0])
    candidates = [kwargs.get("input_ids"), *args, *kwargs.values()]
    tensors = [value for value in candidates if isinstance(value, torch.Tensor) and value.dim() >= 1]
    integer = [value for value in tensors if not value.is_floating_point()]
    found = integer or tensors
    return found[0] if found else None


def count_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Tokens in a batch: the elements of ``input_ids`` or of the first integer tensor argument."""
    tensor = _batch_tensor(args, kwargs)
    return 0 if tensor is None or tensor.is_floating_point() else tensor.numel()


def count_samples(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Samples in a batch: the leading dimension of its batch tensor."""
    tensor = _batch_tensor(args, kwargs)
    return 0 if tensor is None else int(tensor.shape[0])


class LossNotFoundError(ValueError):
    """The model's output carries no loss to profile with (and no ``loss_fn`` says where)."""


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss``, or the output itself when it is a scalar tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise LossNotFoundError(
            "cannot find the loss in the model's output for profiling: return it as output.loss or "
            "a scalar, or pass initialize(..., loss_fn=lambda output: ...)"
        )
    return loss

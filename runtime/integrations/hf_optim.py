"""``TrainingArguments.optim`` (and ``optim_args``) in ProTrain's terms: the Trainer's optimizer
names that are one of the engine's rules, and why the others are refused."""

from __future__ import annotations

from typing import Any

from protrain.runtime.optim.registry import REFUSED

TRAINER_OPTIMS = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "lion_32bit": "lion",
    "sgd": "sgd",
}
"""Trainer ``optim`` values whose update one of the engine's rules runs exactly, in fp32 state
(the Trainer's lion_32bit is bitsandbytes' Lion with adam_beta1 and adam_beta2 as its betas)."""
OPTIM_OF_TYPE = {"adamw": "adamw_torch_fused", "lion": "lion_32bit", "sgd": "sgd"}
"""The Trainer's name for a rule (adam has none: the Trainer offers no plain Adam)."""
SGD_OPTIM_ARGS = ("momentum", "dampening", "nesterov")
"""The ``optim_args`` keys the Trainer's SGD reads that the spec holds (weight_decay is the
Trainer's own field)."""


def optim_name(args: Any) -> str:
    return str(getattr(args.optim, "value", args.optim))


def refusal(optim: str) -> str | None:
    """Why ``optim`` cannot run under ProTrain, or None where a rule runs it."""
    if optim in TRAINER_OPTIMS:
        return None
    if optim in REFUSED:
        return f"optim={optim!r}: {REFUSED[optim]}"
    offered = ", ".join(f"{name} ({rule})" for name, rule in TRAINER_OPTIMS.items())
    return (
        f"optim={optim!r} is not one of the optimizers ProTrain runs on its chunks ({offered}; adam "
        "through the spec's optimizer.type); 8-bit, paged and layer-wise optimizers keep state the "
        "chunk engine does not shard"
    )


def sgd_values(optim_args: str | None) -> dict[str, Any]:
    """The spec's sgd values that ``optim_args`` ("momentum=0.9,nesterov=True") sets, read as
    the Trainer reads them."""
    values: dict[str, Any] = {}
    for item in (optim_args or "").replace(" ", "").split(","):
        key, _, text = item.partition("=")
        if key in ("momentum", "dampening"):
            values[key] = float(text)
        elif key == "nesterov":
            values[key] = text.lower() in ("true", "1", "yes")
    return values

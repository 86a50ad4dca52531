"""The optimizer rules ``optimizer.type`` may name: adamw (the default), adam, lion and sgd
(docs/optimizers.md). A rule is added by writing its kernel (a module like lion.py) and
registering it here, in one line, or at run time with ``register`` (a test-only rule registers
itself from its test file)."""

from __future__ import annotations

from protrain.runtime.optim.rule import OptimizerRule

_RULES: dict[str, OptimizerRule] = {}


def register(rule: OptimizerRule) -> OptimizerRule:
    """Make ``rule`` nameable by ``optimizer.type``. Registering the same rule again is a no-op;
    another rule under a taken name is refused."""
    known = _RULES.get(rule.name)
    if known is not None and known != rule:
        raise ValueError(f"an optimizer rule named {rule.name!r} is registered already")
    _RULES[rule.name] = rule
    return rule


def registered() -> tuple[str, ...]:
    """The names ``optimizer.type`` accepts, in registration order."""
    return tuple(_RULES)


REFUSED: dict[str, str] = {
    "adafactor": (
        "Adafactor is not offered: its factored second moment needs the row and column sums of "
        "each whole weight matrix, which a flat shard splits across ranks and chunks (and Hugging "
        "Face's and torch's Adafactor differ); ProTrain never approximates an update silently. "
        "Use adamw, or lion or sgd for less optimizer memory"
    ),
}
"""Optimizers people ask for by name that no rule runs, each with why."""


def rule_named(name: str) -> OptimizerRule:
    try:
        return _RULES[name]
    except KeyError:
        if name in REFUSED:
            raise ValueError(f"optimizer.type {name!r}: {REFUSED[name]}") from None
        raise ValueError(f"optimizer.type {name!r} is not one of {', '.join(registered())}") from None


ADAMW = register(
    OptimizerRule(
        name="adamw",
        state_names=("exp_avg", "exp_avg_sq"),
        kernel="protrain.runtime.optim.adamw:build_adamw",
        reference="torch.optim.AdamW",
    )
)
ADAM = register(
    OptimizerRule(
        name="adam",
        state_names=("exp_avg", "exp_avg_sq"),
        kernel="protrain.runtime.optim.adamw:build_adam",
        reference="torch.optim.Adam (weight decay as L2, added to the gradient)",
    )
)
LION = register(
    OptimizerRule(
        name="lion",
        state_names=("exp_avg",),
        kernel="protrain.runtime.optim.lion:ShardLion",
        reference="Lion as published (Chen et al. 2023, Algorithm 2), decoupled weight decay",
        bytes_moved=4 * 6,  # master, gradient, moment read; master, moment written; the sign
    )
)
SGD = register(
    OptimizerRule(
        name="sgd",
        state_names=("momentum_buffer",),
        kernel="protrain.runtime.optim.sgd:ShardSGD",
        reference="torch.optim.SGD (momentum, dampening, nesterov, weight decay as L2)",
        momentum_buffer=True,
        bytes_moved=4 * 6,
    )
)

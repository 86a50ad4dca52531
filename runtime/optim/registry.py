"""The optimizer rules ``optimizer.type`` may name. AdamW is the built-in one; a rule is added
by writing its kernel (a module like adamw.py) and registering it here, in one line, or at run
time with ``register`` (a test-only rule registers itself from its test file)."""

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


def rule_named(name: str) -> OptimizerRule:
    try:
        return _RULES[name]
    except KeyError:
        raise ValueError(f"optimizer.type {name!r} is not one of {', '.join(registered())}") from None


ADAMW = register(
    OptimizerRule(
        name="adamw",
        state_names=("exp_avg", "exp_avg_sq"),
        kernel="protrain.runtime.optim.adamw:build_adamw",
        reference="torch.optim.AdamW",
    )
)

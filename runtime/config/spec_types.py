"""The value types of the job spec's fields, and their strict parsing.

Each leaf type (``PositiveInt``, ``AutoSize``, ``Betas`` ...) is an ``Annotated`` type whose
validator accepts exactly what its ``Allowed`` phrase says: no bool for an int, no float for an
int, no string for a number; ``"auto"`` only in the ``Auto*`` types, which mark themselves
``AutoFilled``. The same phrase goes into error messages and docs/spec-reference.md, so
the two cannot disagree. ``SpecModel`` is the base of every spec section (here so the hardware
files share it). The sections themselves are ``runtime/config/spec.py``.

Importing this module must not import torch (see runtime/config/spec.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, PlainSerializer, PlainValidator
from pydantic_core import PydanticCustomError

from protrain.profiler.plan import BlockMode

AUTO: Final = "auto"
"""Typed ``Literal["auto"]`` (Final), so a field typed ``X | Auto`` may default to it and ``== AUTO`` narrows."""
Auto = Literal["auto"]


# --------------------------------------------------------------------------------------------
# Leaf types. Each carries an ``Allowed`` phrase used both in error messages and in the README's
# spec reference, so the two can never disagree.
# --------------------------------------------------------------------------------------------


class Allowed:
    """Metadata marker: what a field accepts, in words."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Allowed({self.text!r})"


class AutoFilled:
    """Metadata marker: ``"auto"`` in this field is a placeholder the planner or launcher fills."""

    __slots__ = ()


class TrainerFilled:
    """Metadata marker: ``"auto"`` in this training field is filled from ``TrainingArguments`` by
    the Hugging Face Trainer integration (as DeepSpeed's config takes "auto" there); without it,
    ``runtime.initialize`` refuses it (``trainer_autos``)."""

    __slots__ = ()


TRAINER_AUTO_TEXT = '"auto" (ProTrainTrainer fills it from TrainingArguments)'


def _reject(allowed: str) -> PydanticCustomError:
    return PydanticCustomError("spec_value", "expected {allowed}", {"allowed": allowed})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _leaf(
    check: Callable[[Any], Any], allowed: str, *, auto: bool = False, trainer_auto: bool = False
) -> tuple[Any, ...]:
    """Build Annotated metadata for a leaf: ``check`` returns the value or raises ValueError.
    ``auto``: "auto" is the planner's or launcher's to fill; ``trainer_auto``: the Trainer
    integration's (``TrainerFilled``)."""
    text = f'{allowed}, or "auto"' if auto else allowed
    if trainer_auto:
        text = f"{allowed}, or {TRAINER_AUTO_TEXT}"

    def validate(value: Any) -> Any:
        if (auto or trainer_auto) and value == AUTO:
            return AUTO
        try:
            return check(value)
        except (ValueError, TypeError):
            raise _reject(text) from None

    markers: tuple[Any, ...] = (PlainValidator(validate), PlainSerializer(_to_plain), Allowed(text))
    return markers + ((AutoFilled(),) if auto else ()) + ((TrainerFilled(),) if trainer_auto else ())


def _to_plain(value: Any) -> Any:
    """Serialise a leaf as plain JSON-able data (enums by value, tuples as lists)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_to_plain(item) for item in value]
    return value


def _int_check(minimum: int | None = None, maximum: int | None = None) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if not _is_int(value):
            raise TypeError
        if minimum is not None and value < minimum:
            raise ValueError
        if maximum is not None and value > maximum:
            raise ValueError
        return int(value)

    return check


def _float_check(
    minimum: float | None = None, maximum: float | None = None, *, open_min: bool = False
) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if not _is_number(value) or not math.isfinite(value):
            raise TypeError
        if minimum is not None and (value < minimum or (open_min and value == minimum)):
            raise ValueError
        if maximum is not None and value > maximum:
            raise ValueError
        return float(value)

    return check


def _bool_check(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError
    return value


def _str_check(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TypeError
    return value


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``"22GiB"``, ``"512 MiB"``, ``"4.1GB"`` (decimal
    arithmetic, so a size written with decimals means exactly that many bytes)."""
    if _is_int(value):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"size must be an integer or a string like '22GiB', got {value!r}")
    match = _SIZE_RE.match(value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read {value!r} as a size")
    number, unit = match.groups()
    size = Decimal(number) * _SIZE_UNITS[unit.lower()]
    if size != size.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(size)


def _positive_size(value: Any) -> int:
    size = parse_size(value)
    if size <= 0:
        raise ValueError
    return size


_SIZE_TEXT = 'a size in bytes: an integer or a string such as "22GiB", "512MiB", "1.5GB"'

NonNegInt = Annotated[(int, *_leaf(_int_check(0), "an integer >= 0"))]
PositiveInt = Annotated[(int, *_leaf(_int_check(1), "an integer >= 1"))]
Port = Annotated[(int, *_leaf(_int_check(0, 65535), "an integer port 0..65535 (0: a free port)"))]
PositiveFloat = Annotated[(float, *_leaf(_float_check(0.0, open_min=True), "a number > 0"))]
NonNegFloat = Annotated[(float, *_leaf(_float_check(0.0), "a number >= 0"))]
Fraction = Annotated[(float, *_leaf(_float_check(0.0, 1.0), "a number in [0, 1]"))]
Bool = Annotated[(bool, *_leaf(_bool_check, "true or false"))]
Text = Annotated[(str, *_leaf(_str_check, "a non-empty string"))]

Size = Annotated[(int, *_leaf(_positive_size, _SIZE_TEXT + " (> 0)"))]
AutoSize = Annotated[(int | Auto, *_leaf(_positive_size, _SIZE_TEXT + " (> 0)", auto=True))]
AutoNonNegInt = Annotated[(int | Auto, *_leaf(_int_check(0), "an integer >= 0", auto=True))]
AutoPositiveInt = Annotated[(int | Auto, *_leaf(_int_check(1), "an integer >= 1", auto=True))]
TrainerNonNegInt = Annotated[(int | Auto, *_leaf(_int_check(0), "an integer >= 0", trainer_auto=True))]
TrainerPositiveInt = Annotated[(int | Auto, *_leaf(_int_check(1), "an integer >= 1", trainer_auto=True))]
TrainerPositiveFloat = Annotated[
    (float | Auto, *_leaf(_float_check(0.0, open_min=True), "a number > 0", trainer_auto=True))
]
TrainerNonNegFloat = Annotated[(float | Auto, *_leaf(_float_check(0.0), "a number >= 0", trainer_auto=True))]
AutoText = Annotated[(str | Auto, *_leaf(_str_check, "a module path such as model.layers", auto=True))]


def enum_leaf(enum_type: type[Enum], *, trainer_auto: bool = False) -> tuple[Any, ...]:
    """Annotated metadata for a field holding ``enum_type``: its values by name, strictly
    (``trainer_auto``: or "auto", see ``TrainerFilled``)."""
    names = [member.value for member in enum_type]
    allowed = "one of " + ", ".join(names)

    def check(value: Any) -> Enum:
        if isinstance(value, enum_type):
            return value
        if not isinstance(value, str) or value not in names:
            raise ValueError
        return enum_type(value)

    return _leaf(check, allowed, trainer_auto=trainer_auto)


def registered_leaf(
    names: Callable[[], Sequence[str]], note: str, refused: Callable[[], Mapping[str, str]] = dict
) -> tuple[Any, ...]:
    """Annotated metadata for a field naming a registered entry (an optimizer rule): checked
    against what is registered when the spec is read, so a rule registered at run time counts;
    the reference lists those registered at import, with ``note``. A name in ``refused`` is
    told its reason beside what is allowed."""
    allowed = f"one of {', '.join(names())} ({note})"
    markers = _leaf(lambda value: value, allowed)

    def validate(value: Any) -> str:
        if isinstance(value, str) and value in names():
            return value
        reason = refused().get(value) if isinstance(value, str) else None
        if reason:
            raise PydanticCustomError("spec_refused", "{reason}", {"reason": reason})
        raise _reject(allowed)

    return (PlainValidator(validate), *markers[1:])


def _betas_check(value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError
    beta = _float_check(0.0, 1.0)
    first, second = beta(value[0]), beta(value[1])
    if first >= 1.0 or second >= 1.0:
        raise ValueError
    return (first, second)


def _text_list_check(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError
    return tuple(_str_check(item) for item in value)


def _block_modes_check(value: Any) -> tuple[BlockMode, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError
    names = {mode.value for mode in BlockMode}
    if not all(isinstance(item, str) and item in names for item in value):
        raise ValueError
    return tuple(BlockMode(item) for item in value)


Betas = Annotated[(tuple[float, float], *_leaf(_betas_check, "a list of two numbers in [0, 1)"))]
TrainerBetas = Annotated[
    (
        tuple[float, float] | Auto,
        *_leaf(_betas_check, "a list of two numbers in [0, 1)", trainer_auto=True),
    )
]
TextList = Annotated[(tuple[str, ...], *_leaf(_text_list_check, "a list of non-empty strings"))]
BlockModes = Annotated[
    (
        tuple[BlockMode, ...],
        *_leaf(_block_modes_check, "a non-empty list of keep, swap, checkpoint, ssd (one per block)"),
    )
]
Resume = Annotated[(str, *_leaf(_str_check, '"auto", "never", or the path of a checkpoint directory'))]


@dataclass(frozen=True, slots=True)
class ParamGroup:
    """One entry of ``optimizer.groups``: the parameters whose names match one of ``match``
    (shell-style patterns over the whole dotted name, ``*`` crossing dots) take the values set
    here; a value left out is the top-level one."""

    match: tuple[str, ...]
    lr: float | None = None
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None

    def as_plain(self) -> dict[str, Any]:
        plain: dict[str, Any] = {"match": list(self.match)}
        for key in ("lr", "weight_decay", "betas"):
            value = getattr(self, key)
            if value is not None:
                plain[key] = list(value) if isinstance(value, tuple) else value
        return plain


_GROUP_KEYS = ("match", "lr", "weight_decay", "betas")
_GROUPS_TEXT = (
    "a list of {match: [patterns], lr, weight_decay, betas} entries (match required; the first "
    "entry that matches a parameter's name wins)"
)


def _group_entry(index: int, entry: Any) -> ParamGroup:
    """One entry, or an error naming the entry's key (``optimizer.groups.<index>.<key>``)."""
    if not isinstance(entry, dict):
        raise cross_field_error(str(index), f"got {entry!r}; allowed: {_GROUPS_TEXT}")
    for key in entry:
        if key not in _GROUP_KEYS:
            raise cross_field_error(
                f"{index}.{key}", f"unknown key {key!r}; allowed keys here: {', '.join(_GROUP_KEYS)}"
            )
    if "match" not in entry:
        raise cross_field_error(f"{index}.match", "required key is missing (the patterns of names it takes)")
    checks: dict[str, tuple[Callable[[Any], Any], str]] = {
        "match": (_nonempty_text_list_check, "a non-empty list of non-empty strings"),
        "lr": (_float_check(0.0, open_min=True), "a number > 0"),
        "weight_decay": (_float_check(0.0), "a number >= 0"),
        "betas": (_betas_check, "a list of two numbers in [0, 1)"),
    }
    values: dict[str, Any] = {}
    for key, value in entry.items():
        check, allowed = checks[key]
        try:
            values[key] = check(value)
        except (ValueError, TypeError):
            raise cross_field_error(f"{index}.{key}", f"got {value!r}; allowed: {allowed}") from None
    return ParamGroup(**values)


def _groups_check(value: Any) -> tuple[ParamGroup, ...]:
    if not isinstance(value, (list, tuple)):
        raise _reject(_GROUPS_TEXT)
    return tuple(
        entry if isinstance(entry, ParamGroup) else _group_entry(index, entry) for index, entry in enumerate(value)
    )


def _nonempty_text_list_check(value: Any) -> tuple[str, ...]:
    checked = _text_list_check(value)
    if not checked:
        raise ValueError
    return checked


ParamGroups = Annotated[
    (
        tuple[ParamGroup, ...],
        PlainValidator(_groups_check),
        PlainSerializer(lambda groups: [group.as_plain() for group in groups]),
        Allowed(_GROUPS_TEXT),
    )
]


def cross_field_error(key: str, message: str) -> PydanticCustomError:
    """A check that involves several fields; ``key`` is relative to the model raising it."""
    return PydanticCustomError("spec_cross_field", "{message}", {"key": key, "message": message})


class SpecModel(BaseModel):
    """Base of every spec section: frozen, unknown keys rejected, docstrings as descriptions."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, validate_default=True)

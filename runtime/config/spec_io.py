"""Reading a job spec from JSON or YAML, applying ``--set`` overrides, and turning validation
failures into one readable message per problem (file, key path, value, what is allowed).

The resolved spec travels to the ranks as one JSON file (``ResolvedSpec``), never as
environment strings. Importing this module must not import torch.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from protrain.runtime.config.spec import Spec, auto_fields, trainer_autos
from protrain.runtime.config.spec_types import Allowed

RESOLVED_SPEC_ENV = "PROTRAIN_SPEC"
RESOLVED_SPEC_VERSION = 1


class SpecError(ValueError):
    """Bad job input; the message is complete and meant for the user as is."""


def refuse_trainer_autos(spec: Spec) -> None:
    """SpecError naming every training field left "auto" (lr, batch sizes, precision, seed...):
    only the Hugging Face Trainer integration fills those, from its TrainingArguments."""
    autos = trainer_autos(spec)
    if autos:
        raise SpecError(
            f'{", ".join(autos)}: "auto" here is filled from TrainingArguments by ProTrainTrainer '
            "(runtime.integrations.hf) only; set a value to train without it"
        )


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars and no duplicate keys.

    PyYAML resolves YAML 1.1: ``3e-4`` stays a string, ``010`` is octal 8, ``1:30`` is 90,
    ``on``/``no`` are booleans and ``2024-01-01`` is a date. A spec means what it says, so only
    ``true``/``false``, decimal integers and decimal floats are resolved; the rest are strings."""


_BOOL_TAG, _INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_StrictYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL_TAG, _INT_TAG, _FLOAT_TAG, _TIMESTAMP_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictYamlLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_StrictYamlLoader.add_implicit_resolver(_INT_TAG, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_StrictYamlLoader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"""^(?:[-+]?(?:[0-9]+)?\.[0-9]+(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9]+\.(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9]+[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_decimal_int(loader: _StrictYamlLoader, node: yaml.ScalarNode) -> int:
    return int(loader.construct_scalar(node), 10)


def _construct_mapping(loader: _StrictYamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if not isinstance(key, (str, int, float, bool)) and key is not None:
            raise SpecError(f"a key at line {line} is a {type(key).__name__}; keys must be plain names")
        if key in mapping:
            raise SpecError(f"duplicate key {key!r} at line {line}")
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_StrictYamlLoader.add_constructor(_INT_TAG, _construct_decimal_int)
_StrictYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _reject_duplicate_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    mapping: dict[str, Any] = {}
    for key, value in pairs:
        if key in mapping:
            raise SpecError(f"duplicate key {key!r}")
        mapping[key] = value
    return mapping


def parse_text(text: str, *, json_syntax: bool) -> Any:
    """Parse JSON or YAML text; raises SpecError (without the file name) on bad syntax."""
    if json_syntax:
        try:
            return json.loads(text, object_pairs_hook=_reject_duplicate_json_keys)
        except json.JSONDecodeError as err:
            raise SpecError(f"JSON syntax error at line {err.lineno}, column {err.colno}: {err.msg}") from None
        except RecursionError:
            raise SpecError("JSON nested too deeply") from None
    try:
        return yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"YAML syntax error{where}: {err.problem}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"YAML syntax error: {err}") from None
    except RecursionError:
        raise SpecError("YAML nested too deeply") from None


def read_spec_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw mapping in a JSON (``.json``) or YAML file; SpecError names the file."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{file}: no such file") from None
    except IsADirectoryError:
        raise SpecError(f"{file}: is a directory, expected a JSON or YAML file") from None
    except PermissionError:
        raise SpecError(f"{file}: permission denied") from None
    except UnicodeDecodeError:
        raise SpecError(f"{file}: not UTF-8 text") from None
    except OSError as err:
        raise SpecError(f"{file}: cannot read ({err.strerror})") from None
    try:
        data = parse_text(text, json_syntax=file.suffix.lower() == ".json")
    except SpecError as err:
        raise SpecError(f"{file}: {err}") from None
    if data is None:
        raise SpecError(f"{file}: empty file, expected a mapping of spec keys")
    if not isinstance(data, dict):
        raise SpecError(f"{file}: top level must be a mapping of spec keys, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Override:
    """One ``key.path=value`` assignment and where it came from (for error messages)."""

    key_path: tuple[str, ...]
    value: Any
    source: str


_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_override(text: str, *, source: str | None = None) -> Override:
    """``"memory.n_swap=2"`` -> Override; the value is read as a YAML scalar or flow value."""
    label = source or f"--set {text}"
    key, sep, raw_value = text.partition("=")
    key = key.strip()
    if not sep:
        raise SpecError(f"{label}: expected KEY.PATH=VALUE, e.g. --set memory.n_swap=2")
    if not _KEY_RE.match(key):
        raise SpecError(f"{label}: {key!r} is not a key path (dotted names, e.g. optimizer.lr)")
    if not raw_value.strip():
        raise SpecError(f"{label}: missing value after '='")
    try:
        value = parse_text(raw_value, json_syntax=False)
    except SpecError as err:
        raise SpecError(f"{label}: {err}") from None
    return Override(key_path=tuple(key.split(".")), value=value, source=label)


def apply_overrides(data: dict[str, Any], overrides: list[Override]) -> dict[str, Any]:
    """A copy of ``data`` with each override applied in order (later ones win)."""
    result = copy.deepcopy(data) if data else {}
    for override in overrides:
        node = result
        for depth, key in enumerate(override.key_path[:-1]):
            child = node.setdefault(key, {})
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                prefix = ".".join(override.key_path[: depth + 1])
                raise SpecError(f"{override.source}: {prefix} is not a section, cannot set a key inside it")
            node = child
        node[override.key_path[-1]] = override.value
    return result


# --------------------------------------------------------------------------------------------
# Validation and error messages
# --------------------------------------------------------------------------------------------


def _section_at(model: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The spec section class reached by following ``loc`` from ``model``."""
    current: type[BaseModel] | None = model
    for key in loc:
        if current is None or key not in current.model_fields:
            return None
        current = section_type(current.model_fields[key].annotation)
    return current


def section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = section_type(arg)
        if found is not None:
            return found
    return None


def allowed_text(model: type[BaseModel], loc: tuple[str, ...]) -> str | None:
    parent = _section_at(model, loc[:-1])
    if parent is None or loc[-1] not in parent.model_fields:
        return None
    info = parent.model_fields[loc[-1]]
    for marker in info.metadata:
        if isinstance(marker, Allowed):
            return marker.text
    nested = _nested_allowed(info.annotation)
    if nested is not None:
        return nested + (", or null" if type(None) in get_args(info.annotation) else "")
    if section_type(info.annotation) is not None:
        return "a mapping of keys" + (" or null" if "None" in repr(info.annotation) else "")
    return None


def _nested_allowed(annotation: Any) -> str | None:
    """The Allowed text inside an Optional[Annotated[...]] annotation."""
    if get_origin(annotation) is Annotated:
        for marker in get_args(annotation)[1:]:
            if isinstance(marker, Allowed):
                return marker.text
    for arg in get_args(annotation):
        found = _nested_allowed(arg)
        if found is not None:
            return found
    return None


def _field_path(loc: tuple[Any, ...], *, unknown_key: bool, root: type[BaseModel] = Spec) -> tuple[str, ...]:
    """The spec key path of an error location, without pydantic's union-branch tags and list
    indices; for an unknown key, its own name is kept as the last element."""
    path: list[str] = []
    current: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, str) and current is not None and part in current.model_fields:
            path.append(part)
            current = section_type(current.model_fields[part].annotation)
    if unknown_key and loc and isinstance(loc[-1], str) and (not path or path[-1] != loc[-1]):
        path.append(loc[-1])
    return tuple(path)


def _describe(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _source_of(path: tuple[str, ...], sources: dict[tuple[str, ...], str], default: str) -> str:
    """The override that set this key (or a key inside it, or a section holding it)."""
    for length in range(len(path), 0, -1):
        if path[:length] in sources:
            return sources[path[:length]]
    inside = [source for key, source in sources.items() if path and key[: len(path)] == path]
    return inside[-1] if inside else default


def format_validation_error(
    err: ValidationError,
    *,
    source: str,
    override_sources: dict[tuple[str, ...], str] | None = None,
    root: type[BaseModel] = Spec,
) -> str:
    """One line per problem: ``<file or --set>: <key.path>: <what is wrong>; allowed: ...``.
    ``root``: the model validated (the job spec, or another file kind such as a hardware file)."""
    sources = override_sources or {}
    lines: list[str] = []
    seen: set[str] = set()
    for error in err.errors(include_url=False):
        path = _field_path(error["loc"], unknown_key=error["type"] == "extra_forbidden", root=root)
        kind = error["type"]
        if kind == "spec_cross_field":
            ctx = error.get("ctx", {})
            path = path + tuple(str(ctx.get("key", "")).split("."))
            message = str(ctx.get("message", error["msg"]))
        elif kind == "extra_forbidden":
            section = _section_at(root, path[:-1])
            allowed = ", ".join(section.model_fields) if section else "none"
            message = f"unknown key {path[-1]!r}; allowed keys here: {allowed}"
        elif kind == "missing":
            message = "required key is missing"
        elif kind == "spec_refused":  # a name people ask for that is refused with a reason
            what = allowed_text(root, path) if path else None
            message = f"got {_describe(error['input'])}: {error['msg']}; allowed: {what}"
        else:
            what = allowed_text(root, path) if path else None
            got = _describe(error["input"])
            message = f"got {got}; allowed: {what or error['msg']}"
        key = ".".join(path) or "(top level)"
        line = f"{_source_of(path, sources, source)}: {key}: {message}"
        if line not in seen:
            seen.add(line)
            lines.append(line)
    return "\n".join(lines)


def validate_spec(
    data: dict[str, Any], *, source: str, override_sources: dict[tuple[str, ...], str] | None = None
) -> Spec:
    """A ``Spec`` from a raw mapping, or SpecError with every problem listed."""
    try:
        return Spec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, source=source, override_sources=override_sources)) from None


def load_spec(path: str | os.PathLike[str] | None, overrides: list[Override] | None = None) -> Spec:
    """Read, override, validate. ``path=None`` starts from the defaults."""
    overrides = overrides or []
    source = str(path) if path is not None else "(defaults)"
    data = read_spec_file(path) if path is not None else {}
    merged = apply_overrides(data, overrides)
    sources = {override.key_path: override.source for override in overrides}
    return validate_spec(merged, source=source, override_sources=sources)


# --------------------------------------------------------------------------------------------
# The resolved spec file handed to the ranks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedSpec:
    """What the launcher hands each rank: the validated spec plus how it came to be."""

    spec: Spec
    source: str
    overrides: tuple[str, ...] = ()
    auto: tuple[str, ...] = ()
    dry_run: bool = False
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        body = {
            "version": RESOLVED_SPEC_VERSION,
            "source": self.source,
            "overrides": list(self.overrides),
            "auto": list(self.auto),
            "dry_run": self.dry_run,
            "world_size": self.world_size,
            "spec": self.spec.model_dump(mode="json"),
            # The keys the user wrote (file and --set): what a value "left at its default" means to
            # whoever reads the spec on the ranks (ProTrainTrainer reconciles TrainingArguments by it).
            "written": self.spec.model_dump(mode="json", exclude_unset=True),
        }
        return json.dumps(body, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, *, path: str) -> ResolvedSpec:
        body = json.loads(text)
        if body.get("version") != RESOLVED_SPEC_VERSION:
            raise SpecError(f"{path}: resolved spec version {body.get('version')!r}, expected {RESOLVED_SPEC_VERSION}")
        # From the written keys, the defaults filled alike: the same spec, knowing what was set.
        spec = validate_spec(body.get("written", body["spec"]), source=path)
        return cls(
            spec=spec,
            source=str(body["source"]),
            overrides=tuple(body["overrides"]),
            auto=tuple(body["auto"]),
            dry_run=bool(body["dry_run"]),
            world_size=int(body["world_size"]),
        )

    @classmethod
    def of(
        cls,
        spec: Spec,
        *,
        source: str,
        overrides: tuple[str, ...] = (),
        dry_run: bool = False,
        world_size: int = 1,
    ) -> ResolvedSpec:
        return cls(
            spec=spec,
            source=source,
            overrides=overrides,
            auto=tuple(auto_fields(spec)),
            dry_run=dry_run,
            world_size=world_size,
        )


def write_resolved(resolved: ResolvedSpec, path: Path) -> None:
    """Write atomically (temporary file, then rename) so a rank never reads half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(resolved.to_json(), encoding="utf-8")
    os.replace(tmp, path)


def read_resolved(path: str | os.PathLike[str]) -> ResolvedSpec:
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"{file}: cannot read the resolved spec ({err.strerror})") from None
    return ResolvedSpec.from_json(text, path=str(file))

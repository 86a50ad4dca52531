"""The README's spec reference, generated from the pydantic models so the two cannot drift.

python -m runtime.spec_doc            # print the reference table
python -m runtime.spec_doc --write    # rewrite the README section between its markers
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path

from pydantic import BaseModel

from runtime.spec import Spec
from runtime.spec_io import allowed_text, section_type

START = "<!-- spec-reference:start -->"
END = "<!-- spec-reference:end -->"


def _default_text(model: type[BaseModel], name: str) -> str:
    info = model.model_fields[name]
    if info.default_factory is not None:
        return "(section)"
    value = info.default
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, tuple):
        value = [v.value if isinstance(v, Enum) else v for v in value]
    return f"`{json.dumps(value)}`"


def _rows(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[str]:
    rows: list[str] = []
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        section = section_type(info.annotation)
        description = " ".join((info.description or "").split()).replace("|", "\\|")
        if section is not None:
            optional = " (or null)" if "None" in repr(info.annotation) else ""
            rows.append(
                f"| `{'.'.join(path)}` | section{optional} | {_default_text(model, name)} | {description} |"
            )
            rows.extend(_rows(section, path))
        else:
            allowed = (allowed_text(Spec, path) or "").replace("|", "\\|")
            rows.append(f"| `{'.'.join(path)}` | {allowed} | {_default_text(model, name)} | {description} |")
    return rows


def reference_markdown() -> str:
    header = ["| key | allowed | default | meaning |", "| --- | --- | --- | --- |"]
    return "\n".join(header + _rows(Spec)) + "\n"


def readme_with_reference(readme: str) -> str:
    before, start, rest = readme.partition(START)
    _, end, after = rest.partition(END)
    if not start or not end:
        raise ValueError(f"README lacks the markers {START} ... {END}")
    return f"{before}{START}\n{reference_markdown()}{END}{after}"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        readme = Path(__file__).resolve().parents[1] / "README.md"
        readme.write_text(readme_with_reference(readme.read_text()))
        return 0
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""The job spec reference (docs/spec-reference.md), generated from the pydantic models so the two
cannot drift; tests/unit/test_readme.py checks the page is current.

python -m protrain.runtime.config.spec_doc            # print the reference table
python -m protrain.runtime.config.spec_doc --write    # rewrite the page's table between its markers
                                                      #   (in a checkout; make spec-reference)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from pydantic import BaseModel

from protrain.runtime.config.spec import Spec
from protrain.runtime.config.spec_io import allowed_text, section_type

START = "<!-- spec-reference:start -->"
END = "<!-- spec-reference:end -->"
REFERENCE_PAGE = Path("docs") / "spec-reference.md"
"""The page holding the table, relative to the repository root; its prose is written by hand."""


@dataclass(frozen=True, slots=True)
class ReferenceRow:
    """One key of the spec as the reference shows it (and tests/unit's surface snapshot keeps)."""

    key: str
    """The dotted key path, e.g. memory.ssd.n_offload."""
    allowed: str
    """What the key accepts, in the words of its error messages; "section" for a section."""
    default: str
    """The default as JSON, or "(section)"."""
    meaning: str
    """The field's docstring on one line."""


def _default_text(model: type[BaseModel], name: str) -> str:
    info = model.model_fields[name]
    if info.default_factory is not None:
        return "(section)"
    if info.is_required():
        return "(required)"
    value = info.default
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, tuple):
        value = [v.value if isinstance(v, Enum) else v for v in value]
    return json.dumps(value)


def reference_rows(model: type[BaseModel] = Spec, prefix: tuple[str, ...] = ()) -> list[ReferenceRow]:
    """Every key of ``model``, depth first in declaration order."""
    rows: list[ReferenceRow] = []
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        section = section_type(info.annotation)
        if section is not None:
            allowed = "section" + (" (or null)" if "None" in repr(info.annotation) else "")
        else:
            allowed = allowed_text(Spec, path) or ""
        meaning = " ".join((info.description or "").split())
        rows.append(ReferenceRow(".".join(path), allowed, _default_text(model, name), meaning))
        if section is not None:
            rows.extend(reference_rows(section, path))
    return rows


def _markdown_row(row: ReferenceRow) -> str:
    default = row.default if row.default in ("(section)", "(required)") else f"`{row.default}`"
    cells = (f"`{row.key}`", row.allowed.replace("|", "\\|"), default, row.meaning.replace("|", "\\|"))
    return "| " + " | ".join(cells) + " |"


def reference_markdown() -> str:
    header = ["| key | allowed | default | meaning |", "| --- | --- | --- | --- |"]
    return "\n".join(header + [_markdown_row(row) for row in reference_rows()]) + "\n"


def page_with_reference(page: str) -> str:
    """``page`` with the text between its markers replaced by the current reference table."""
    before, start, rest = page.partition(START)
    _, end, after = rest.partition(END)
    if not start or not end:
        raise ValueError(f"{REFERENCE_PAGE} lacks the markers {START} ... {END}")
    return f"{before}{START}\n{reference_markdown()}{END}{after}"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        page = Path(__file__).resolve().parents[2] / REFERENCE_PAGE
        if not page.is_file():
            sys.stderr.write(f"--write rewrites {REFERENCE_PAGE} in a checkout of ProTrain; no {page}\n")
            return 2
        page.write_text(page_with_reference(page.read_text()))
        return 0
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

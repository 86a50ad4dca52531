"""The README's spec reference is the one generated from the models."""

from __future__ import annotations

from pathlib import Path

from protrain.runtime.config.spec_doc import readme_with_reference

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_spec_reference_is_current() -> None:
    text = README.read_text()
    assert readme_with_reference(text) == text, "run `make spec-reference` and commit README.md"


def test_readme_gives_the_two_commands() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text

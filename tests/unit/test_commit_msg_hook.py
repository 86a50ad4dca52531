"""The commit-msg hook make venv installs: a subject of at most 72 characters, a blank line, a
body; git's comment lines do not count."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[2] / "scripts" / "commit-msg"


@pytest.mark.parametrize(
    ("message", "accepted"),
    [
        ("Say what changed\n\nAnd why it had to.\n", True),
        ("Say what changed\n\nAnd why.\n# Please enter the commit message\n", True),
        ("x" * 73 + "\n\nA body.\n", False),
        ("Say what changed\n", False),
        ("Say what changed\nno blank line\n", False),
        ("\n\nA body without a subject.\n", False),
    ],
    ids=["good", "comments", "long-subject", "no-body", "no-blank-line", "no-subject"],
)
def test_the_hook_takes_a_short_subject_a_blank_line_and_a_body(tmp_path: Path, message: str, accepted: bool) -> None:
    file = tmp_path / "COMMIT_EDITMSG"
    file.write_text(message)
    done = subprocess.run(["sh", str(HOOK), str(file)], capture_output=True, text=True)
    assert (done.returncode == 0) == accepted, done.stderr
    assert accepted or done.stderr.startswith("commit-msg: ")

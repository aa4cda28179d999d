"""Tracked files cite only what a reader of the repository can find.

The seed papers' text and the specs lived beside the repository, not in it, and the issue
tracker's numbers mean nothing to a user: a paper is cited by its authors and title, a decision is
stated where it is made, and a change is described rather than numbered.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

OUTSIDE = re.compile(
    r"papers/00\d|seed-specs|flower-notes|peers\.md|\.\./shared|/work/shared|\bissue #?\d+",
    re.IGNORECASE,
)


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and the repository's .git folder")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in out.stdout.decode("utf-8", "surrogateescape").split("\0") if name]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_tracked_file_cites_what_a_user_does_not_have():
    hits = []
    for name in tracked_files():
        path = ROOT / name
        if name == SELF or not path.is_file():  # this file; a file deleted in the working tree
            continue
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.split("\n"), 1):
            found = OUTSIDE.search(line)
            if found:
                hits.append(f"{name}:{number}: {found.group(0)!r} in {line.strip()[:160]}")
    assert not hits, (
        f"{len(hits)} reference(s) to papers/specs outside the repository or to issue numbers; cite the "
        "paper's authors and title, state the decision in your own words, or drop the issue number:\n" + "\n".join(hits)
    )

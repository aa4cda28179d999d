"""scripts/engine_breaks.sh still applies: each break's text is in its module exactly once, and each
break names a test file that exists (a -k expression that selects no test shows as MISSED when the
script runs). The script stops at the first break that no longer applies, so a refactor of
the engine would otherwise leave the breaks after it unchecked until someone runs it."""

import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "engine_breaks.sh"


def breaks() -> list[list[str]]:
    """The arguments of every ``brk`` call: module, name, text, replacement, -k expression[, test file]."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    calls = [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("brk ")]
    assert calls, "no brk calls found in scripts/engine_breaks.sh"
    return calls


@pytest.mark.parametrize("call", breaks(), ids=lambda call: call[1])
def test_each_break_applies_to_its_module_once(call):
    module, _name, old, new, expression, *test_file = call
    source = (ROOT / "src" / "fedhet" / "engine" / "vectorized" / f"{module}.py").read_text()
    assert source.count(old) == 1, f"'{old}' is in {module}.py {source.count(old)} times: update the script"
    assert old != new and expression
    tests = ROOT / (test_file[0] if test_file else "tests/engine/test_engine_vectorized.py")
    assert tests.is_file(), tests

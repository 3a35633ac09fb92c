"""Module docstrings stay short: the update rule or contract, the invariant, what must never happen.
The derivations, measurements and rationale belong next to the code they explain (a class or
function docstring, a comment) or on the docs site."""
from __future__ import annotations

import ast

from tests.conftest import ROOT

MAX_LINES = 12
FOLDERS = ("p2ptrain", "launcher")


def docstring_lines(path) -> int:
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    return len(docstring.splitlines()) if docstring else 0


def test_every_module_docstring_is_at_most_twelve_lines():
    paths = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "_proto" not in p.parts)
    assert paths
    long = {str(p.relative_to(ROOT)): n for p in paths if (n := docstring_lines(p)) > MAX_LINES}
    assert not long, (f"module docstrings over {MAX_LINES} lines: {long}; keep the rule or contract, the invariant "
                      "and what must never happen, and move the rest next to the code it explains or to docs/")

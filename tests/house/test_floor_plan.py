"""The house rules that no linter checks: every module of moe_rl/ fits on a few screens and says what it owns.

(The import contracts and the formatter run in ``make lint``, which .ci/run runs before the tests.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "moe_rl"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 400


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_a_module_has_at_most_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"{path.relative_to(PACKAGE.parent)} has {lines} lines (> {MAX_LINES}): split it by concern"
    )


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_a_module_says_what_it_owns(path):
    tree = ast.parse(path.read_text())
    if path.name == "__init__.py" and not tree.body:
        return
    assert ast.get_docstring(tree), f"{path.relative_to(PACKAGE.parent)} has no module docstring"

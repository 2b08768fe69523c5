"""No function in sluice/ is over 60 lines (docs/overview.md): a reader holds one on
a screen. Tables of data (metric declarations, name maps) live at module level, where
the rule does not reach."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sluice"
MAX_LINES = 60


def _long_functions() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > MAX_LINES:
                    found.append(
                        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({length})"
                    )
    return found


def test_no_function_is_over_60_lines() -> None:
    assert not _long_functions()


def test_the_checker_sees_functions() -> None:
    # A checker that found no function would pass anything: it must see a known one
    # and measure it from its `def` (decorators aside) to its last line.
    tree = ast.parse((PACKAGE / "engine" / "engine.py").read_text())
    steps = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "step"]
    assert len(steps) == 1 and steps[0].end_lineno is not None
    assert steps[0].end_lineno - steps[0].lineno > 5

"""House rules that a reader relies on: no function in the library is too long to take in."""

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "eqx_gpt"
MAX_LINES = 80


def test_no_function_in_the_library_is_over_80_lines():
    long = [
        f"{path.relative_to(LIBRARY)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(LIBRARY.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]
    assert not long, long

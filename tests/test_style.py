"""House rules that a reader relies on: no function in the library is too long to take in, and
modules that moved keep importing from where they were."""

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


def test_modules_that_moved_into_the_wings_import_from_their_old_paths():
    import importlib

    import eqx_gpt
    from eqx_gpt._moved import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    # The package's functions stay functions, whatever was imported by its old module path.
    assert callable(eqx_gpt.generate) and callable(eqx_gpt.dropout) and callable(eqx_gpt.evaluate)
    from eqx_gpt.data import load_text  # the module, not the eqx_gpt/data/ folder of the corpus

    assert len(load_text()) == 1_115_394
    from eqx_gpt.transformer import translate  # moved to the generation wing

    assert translate is eqx_gpt.translate

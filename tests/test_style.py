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


def test_names_that_moved_between_modules_still_import_from_where_they_were():
    from eqx_gpt.dropout import split_key
    from eqx_gpt.run import RESUMABLE_CHANGES
    from eqx_gpt.schedule import TimePlan, describe_schedule

    from eqx_gpt._checks import OneLineParser
    from eqx_gpt.cli import OneLineParser as new_parser
    from eqx_gpt.data import TRAIN_BATCHES
    from eqx_gpt.streams import TRAIN_BATCHES as new_stream
    from eqx_gpt.streams import split_key as new_split
    from eqx_gpt.training.options import RESUMABLE_CHANGES as new_changes
    from eqx_gpt.training.time_plan import TimePlan as new_plan
    from eqx_gpt.training.train_step import describe_optimizer

    assert OneLineParser is new_parser and TRAIN_BATCHES == new_stream and split_key is new_split
    assert TimePlan is new_plan and describe_schedule is describe_optimizer
    assert RESUMABLE_CHANGES is new_changes

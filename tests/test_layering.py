"""The package's layout, read from its source: the wings, what may import what, no cycles, and no
module reaching into another's private names. ARCHITECTURE.md states these rules; this checks them."""

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "eqx_gpt"
WINGS = ("model", "generation", "training", "data", "commands", "serve")
# What the model may not know of: how it is trained, sampled, stored or fed.
ABOVE_THE_MODEL = (
    "eqx_gpt.generation", "eqx_gpt.training", "eqx_gpt.data", "eqx_gpt.checkpoint", "eqx_gpt.gpt2",
    "eqx_gpt.files", "eqx_gpt.commands.cli", "eqx_gpt.visualize", "eqx_gpt.tokenizer", "eqx_gpt.serve",
)  # fmt: skip
# What the data wing may not know of: it turns files into token shards, for training or anyone.
ABOVE_THE_DATA = (
    "eqx_gpt.model", "eqx_gpt.generation", "eqx_gpt.training", "eqx_gpt.evaluation", "eqx_gpt.checkpoint",
    "eqx_gpt.gpt2", "eqx_gpt.visualize", "eqx_gpt.commands", "eqx_gpt.serve",
)  # fmt: skip


def _module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """`(module, names)` for every `import` and `from ... import` in the file, wherever it is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in LIBRARY.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, names in _imports(path):
            if not module.startswith("eqx_gpt"):
                continue
            # `from eqx_gpt.model import gpt` imports the module eqx_gpt.model.gpt
            targets |= {f"{module}.{n}" for n in names if f"{module}.{n}" in modules} or {module}
        graph[name] = {t for t in targets if t in modules and t != name and t != "eqx_gpt"}
    return graph


def test_the_package_is_a_few_flat_modules_and_its_wings():
    # `__main__.py` is the `python -m eqx_gpt` entry, not a module of the library.
    flat = sorted(p.name for p in LIBRARY.glob("*.py") if p.name != "__main__.py")
    wings = sorted(p.name for p in LIBRARY.iterdir() if (p / "__init__.py").exists())
    assert len(flat) <= 12, flat
    assert len(wings) >= 3 and set(WINGS) <= set(wings), wings


def _longest_chain(graph: dict[str, set[str]], within: str) -> list[str]:
    """The longest path of imports among the modules under `within` (the graph has no cycle)."""
    inside = {
        m: {t for t in ts if t.startswith(within + ".")}
        for m, ts in graph.items()
        if m.startswith(within + ".")
    }
    longest: dict[str, list[str]] = {}

    def chain(module: str) -> list[str]:
        if module not in longest:
            below = [chain(t) for t in sorted(inside.get(module, ()))]
            longest[module] = [module, *max(below, key=len, default=[])]
        return longest[module]

    return max((chain(m) for m in sorted(inside)), key=len, default=[])


def test_the_training_wing_reads_in_one_sitting():
    # At most 16 modules, none a sliver (under 40 lines) but `__init__.py`, and a reader goes down at
    # most 7 modules of imports from `train()` to the step (issue 58: it was 23 modules, 11 deep).
    wing = LIBRARY / "training"
    modules = sorted(wing.glob("*.py"))
    assert len(modules) <= 16, [p.name for p in modules]
    short = [p.name for p in modules if p.name != "__init__.py" and len(p.read_text().splitlines()) < 40]
    assert not short, short
    chain = _longest_chain(_graph(), "eqx_gpt.training")
    assert len(chain) <= 7, " -> ".join(chain)


def test_the_import_graph_has_no_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_the_model_imports_nothing_above_it_and_generation_no_training():
    wrong = []
    for module, targets in _graph().items():
        for target in targets:
            if module.startswith("eqx_gpt.model") and target.startswith(ABOVE_THE_MODEL):
                wrong.append(f"{module} imports {target}")
            if module.startswith("eqx_gpt.generation") and target.startswith("eqx_gpt.training"):
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_the_data_wing_imports_nothing_that_uses_it():
    wrong = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if module.startswith("eqx_gpt.data") and target.startswith(ABOVE_THE_DATA)
    ]
    assert not wrong, wrong


def test_evaluation_imports_no_training_and_only_the_entry_imports_the_commands():
    wrong = []
    for module, targets in _graph().items():
        for target in targets:
            if module == "eqx_gpt.evaluation" and target.startswith("eqx_gpt.training"):
                wrong.append(f"{module} imports {target}")
            commands = target.startswith("eqx_gpt.commands") and not module.startswith("eqx_gpt.commands")
            if commands and module != "eqx_gpt.__main__":
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_no_module_imports_a_private_name_of_another():
    wrong = [
        f"{_module_name(path)} imports {module}.{name}"
        for path in LIBRARY.rglob("*.py")
        for module, names in _imports(path)
        for name in names
        if module.startswith("eqx_gpt") and name.startswith("_") and not name.startswith("__")
    ]
    assert not wrong, wrong


def _exported() -> set[str]:
    """The names in `eqx_gpt.__all__`, read from the source."""
    for node in ast.parse((LIBRARY / "__init__.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("eqx_gpt/__init__.py defines no __all__")


# Benchmarks that time a part of the library no user calls, by the module that holds it. Each is
# a benchmark of that part, so it cannot use a version of its own; no example is ever here.
TIMES_AN_INTERNAL = {
    "bench/flash_attention.py": "eqx_gpt.model.flash_attention",  # the kernels attention takes on a GPU
    "bench/serve.py": "eqx_gpt.serve.batcher",  # the batched-bench table times the decode loop itself
}  # (bench/trackers.py times the trackers, public callbacks)


def test_the_examples_and_benchmarks_import_only_what_eqx_gpt_exports():
    # Module paths are not API: what the repo's own runnable code reaches for, a user may too.
    exported, wrong = _exported(), []
    scripts = sorted([*(LIBRARY.parent / "examples").glob("*.py"), *(LIBRARY.parent / "bench").glob("*.py")])
    assert len(scripts) >= 5, scripts
    for path in scripts:
        where = path.relative_to(LIBRARY.parent)
        for module, names in _imports(path):
            if module == TIMES_AN_INTERNAL.get(str(where)):
                continue
            if module.startswith("eqx_gpt."):
                wrong.append(f"{where} imports {module}")
            elif module == "eqx_gpt":
                wrong += [
                    f"{where} imports eqx_gpt.{n}, which is not exported" for n in names if n not in exported
                ]
    assert not wrong, "\n".join(wrong)

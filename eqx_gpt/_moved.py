"""Modules that moved into the wings keep importing from their old paths: `import
eqx_gpt.train_step` gives `eqx_gpt.training.train_step`, the same module object."""

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    **{f"eqx_gpt.{m}": f"eqx_gpt.model.{m}" for m in (
        "linear", "positions", "norm", "mlp", "attention", "dropout", "block", "stack", "config", "gpt",
        "transformer", "vocab")},
    **{f"eqx_gpt.{m}": f"eqx_gpt.generation.{m}" for m in ("sampling", "generate")},
    **{f"eqx_gpt.{m}": f"eqx_gpt.training.{m}" for m in (
        "train_config", "presets", "schedule", "train_step", "run", "run_dir", "progress", "parallel")},
    "eqx_gpt.data": "eqx_gpt.training.corpus",
}  # fmt: skip


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an import of an old path with the module at its new one (imported on demand)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass  # the module at the new path is already executed


def install() -> None:
    """Alias the old paths. Those already imported are entered in `sys.modules` now, which also
    keeps `eqx_gpt.generate` and `eqx_gpt.dropout` the functions rather than the modules; the rest
    are imported when first asked for, so `import eqx_gpt` does not load the trainer."""
    for old, new in MOVED.items():
        if new in sys.modules:
            sys.modules.setdefault(old, sys.modules[new])
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())  # before the path finder: eqx_gpt/data/ is a folder


def moved_names(module: str, names: dict[str, str]):
    """A module `__getattr__` that keeps names which moved away importable from `module`:
    `names` maps each old name to `"new.module:new_name"`."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, new_name = names[name].split(":")
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__

"""Every exception class eqx_gpt defines is an `EqxGptError` (issue 53): a caller catches the
library's refusals in one place, and the commands print each as one line. Walks every module."""

import importlib
import inspect
import pkgutil

import pytest

import eqx_gpt
from eqx_gpt import EqxGptError
from eqx_gpt.data.shards import Damaged


def _modules():
    for info in pkgutil.walk_packages(eqx_gpt.__path__, "eqx_gpt."):
        if info.name != "eqx_gpt.__main__":
            yield importlib.import_module(info.name)


def test_every_exception_class_of_the_package_derives_from_eqx_gpt_error():
    defined = {
        f"{module.__name__}.{name}": cls
        for module in _modules()
        for name, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == module.__name__
    }
    assert "eqx_gpt.data.shards.Damaged" in defined  # the walk reaches the subpackages
    outside = sorted(name for name, cls in defined.items() if not issubclass(cls, EqxGptError))
    assert not outside, f"exception classes outside EqxGptError: {outside}"
    assert issubclass(Damaged, EqxGptError)


def test_a_picture_path_in_a_missing_folder_is_an_eqx_gpt_error(tmp_path):
    from eqx_gpt.visualize import check_figure_path  # here: matplotlib takes 1 s to import

    with pytest.raises(EqxGptError, match="does not exist; create it"):
        check_figure_path(tmp_path / "missing" / "a.png", "--attention-png")
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(EqxGptError, match="is a folder"):
        check_figure_path(tmp_path / "folder.png", "--attention-png")

"""`train()`'s own arguments, checked before anything touches the disk: each mistake of a Python
caller is one line naming the argument, its value and what would be accepted."""

from collections.abc import Callable
from pathlib import Path

from eqx_gpt._checks import INT32_MAX, as_path, is_whole
from eqx_gpt.errors import TrainingError


def check_train_arguments(
    *,
    out_dir: object,
    resume: object,
    overwrite: object,
    sample_tokens: object,
    log: object,
    progress: object,
    now: object,
) -> Path:
    """Refuse a wrong `train()` argument in one line (a `TypeError` for a wrong type, a
    `TrainingError` for a wrong value); return `out_dir` as a `Path`."""
    out_path = as_path(out_dir, "out_dir")
    if "\0" in str(out_dir):
        raise TrainingError(f"out_dir must be a folder's path, without NUL, got {out_dir!r}")
    for name, value in (("resume", resume), ("overwrite", overwrite), ("progress", progress)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if not is_whole(sample_tokens, 0):  # checked here, not after the run when the sample is drawn
        raise TrainingError(f"sample_tokens must be an integer in [0, {INT32_MAX}], got {sample_tokens!r}")
    if resume and overwrite:
        raise TrainingError("--resume continues the run in --out-dir and --overwrite deletes it; pass one")
    for name, value, takes in (("log", log, "a line (str)"), ("now", now, "nothing and returns seconds")):
        if not callable(value):
            raise TypeError(f"{name} must be a function that takes {takes}, got {value!r}")
    return out_path


def resume_in_python(out_dir: Path) -> str:
    """How a Python caller resumes the run in `out_dir` (what an interrupted `train()` says)."""
    return f"train(..., out_dir={str(out_dir)!r}, resume=True)"


def resume_on_the_command_line(prog: str) -> Callable[[Path], str]:
    """How the command `prog` resumes a run in a folder (what an interrupted `train.py` says)."""
    again = "uv run train.py" if prog == "train.py" else prog
    return lambda out_dir: f"{again} --resume --out-dir {out_dir}"

"""One run in progress, as the loop (`loop.py`), its checkpoints (`saving.py`) and its end
(`end.py`) share it."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eqx_gpt.training.arguments import resume_in_python
from eqx_gpt.training.evaluate import RunEvaluations
from eqx_gpt.training.report import Report
from eqx_gpt.training.setup import RunSetup, TrainState
from eqx_gpt.training.time_plan import TimePlan


@dataclass
class Run:
    """One run in progress: what was resolved, what changes, how it reports (and to its
    callbacks), its time plan, its evaluations, and whether Ctrl-C, SIGTERM or a callback asked
    it to stop."""

    setup: RunSetup
    state: TrainState
    report: Report
    plan: TimePlan
    evaluations: RunEvaluations
    stopping: Callable[[], bool] = lambda: False
    resume_with: Callable[[Path], str] = resume_in_python  # how the caller resumes it

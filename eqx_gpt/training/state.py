"""What a run's loop changes as it trains: the model, the optimiser state, the step, the schedule's
length and the best validation loss. Everything else about a run is fixed at set-up (`RunSetup`)."""

import math
from dataclasses import dataclass

from eqx_gpt.model.gpt import GPT


@dataclass
class TrainState:
    model: GPT
    opt_state: object
    step: int  # optimiser steps done
    horizon: int  # the schedule's length: the run ends here (`--max-minutes` may refit it)
    best_val: float = math.inf
    last_eval: tuple[int, float] | None = None  # (step, val loss) of the latest evaluation
    last_saved: int | None = None  # step of the latest `latest` checkpoint

    @property
    def evaluated(self) -> bool:
        """Whether the current step's evaluation is done."""
        return self.last_eval is not None and self.last_eval[0] == self.step

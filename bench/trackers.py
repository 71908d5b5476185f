"""What a tracker costs a training step: the time of `log(record)` per call, against a step time.

    uv run python bench/trackers.py --step-ms 85              # the cpu preset's step (PERFORMANCE.md)
    uv run python bench/trackers.py --step-ms 12 --log-interval 10 --trackers tensorboard

The trainer sends one train record every `--log-interval` steps and one evaluation record every
`--eval-interval` steps (`eqx_gpt.training.trackers`); nothing is sent at the other steps. So a
tracker's cost per step is (train record time / log interval + evaluation record time / eval
interval), printed as a share of `--step-ms`: the issue's budget is 1%. The evaluation record is
timed apart because the TensorBoard tracker makes its events durable there (an fsync), before the
checkpoint the trainer writes next. W&B runs offline (WANDB_MODE=offline unless set): `log` hands
the record to W&B's own process, whose work runs beside the training, not in it; this times only
the hand-over, as a training step sees it.

Each timing is the median of `--calls` calls, after `--warmup` calls; the tracker writes into a
temporary folder, removed afterwards. Run it on an idle machine.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_description  # noqa: E402 (bench/common.py)

from eqx_gpt.training.trackers import TRACKERS, open_trackers, parse_trackers  # noqa: E402

CONFIG = {"d_model": 384, "n_layers": 6, "lr": 1e-3, "optimizer": "adamw", "batch_size": 32}


def time_calls(log, records: list[dict]) -> float:
    """The median seconds of `log(record)` over `records`."""
    times = []
    for record in records:
        start = time.perf_counter()
        log(record)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(name: str, calls: int, warmup: int, log_interval: int, eval_interval: int) -> tuple[float, float]:
    """Median seconds of a train record and of an evaluation record sent to tracker `name`."""
    with tempfile.TemporaryDirectory() as out:
        trackers = open_trackers([name], out, config=CONFIG, resume_step=None, is_writer=True)
        try:
            steps = [log_interval * (i + 1) for i in range(warmup + calls)]
            train = [{"step": s, "loss": 3.0 - s * 1e-5, "lr": 1e-3, "tokens_per_s": 4.1e4} for s in steps]
            time_calls(trackers.log, train[:warmup])
            train_s = time_calls(trackers.log, train[warmup:])
            evals = [
                {"step": steps[-1] + eval_interval * (i + 1), "train_loss": 2.0, "val_loss": 2.1}
                for i in range(warmup + calls)
            ]
            time_calls(trackers.log, evals[:warmup])
            eval_s = time_calls(trackers.log, evals[warmup:])
        finally:
            trackers.close()
    return train_s, eval_s


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--step-ms", type=float, required=True, help="the training step time to compare with")
    parser.add_argument("--log-interval", type=int, default=10, help="steps between train records")
    parser.add_argument("--eval-interval", type=int, default=250, help="steps between evaluation records")
    parser.add_argument("--trackers", default=",".join(TRACKERS), help="comma list (default: all)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per kind of record")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    print(f"CPU: {cpu_description()}")
    print(
        f"step {args.step_ms:g} ms, a train record every {args.log_interval} steps, an evaluation record "
        f"every {args.eval_interval}; median of {args.calls} calls"
    )
    for name in parse_trackers(args.trackers):
        train_s, eval_s = bench(name, args.calls, args.warmup, args.log_interval, args.eval_interval)
        per_step = train_s / args.log_interval + eval_s / args.eval_interval
        print(
            f"{name:12s} train record {train_s * 1e6:8.1f} us, evaluation record {eval_s * 1e6:8.1f} us; "
            f"per step {per_step * 1e6:7.2f} us = {100 * per_step / (args.step_ms / 1e3):.3f}% of a step"
        )


if __name__ == "__main__":
    main()

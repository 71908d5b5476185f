"""The training wing: `train` (exported as `eqx_gpt.train`) and what a run is made of.

What a run is configured by:
    config      `TrainConfig`, every training setting, validated on construction
    presets     named recipes of model and training values (values only)
    options     `resolve_options`: defaults < preset < settings given (or the checkpoint's, on
                resume); `train()`'s own arguments checked
What it computes:
    data        the corpus (bundled or `--data`, as token shards) and the training batches
    step        the learning-rate schedule, the loss, the optimiser and the jitted train step
    evaluate    a run's evaluations (train and validation loss, the final validation), on
                `eqx_gpt.evaluation`
How it runs:
    setup       `set_up`: every check before the first step; `RunSetup` (fixed) and `TrainState`
    run         the run top to bottom: `train`, then the loop, its checkpoints and its end
    report      `Report`: log lines, metrics.jsonl, the loss plot, the progress bar, tokens/s
    time_plan   `TimePlan`: the schedule's length fitted to `--max-minutes`
    run_dir     the run's folder: its lock, refusals, and metrics.jsonl
    parallel    the device mesh, data parallelism and FSDP, multi-host start
What it tells:
    records     `StepRecord`, `EvaluationRecord`, `FinalRecord`: metrics.jsonl's lines, typed;
                `TrainResult`, its `history` the run's records
    callbacks   `Callback`, `StopTraining`: seams in a run; `StopFlag`, how a run is asked to stop
    trackers    the records sent to TensorBoard or W&B too
"""

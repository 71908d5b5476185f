"""The training wing: what a run is configured by (`train_config`, `presets`), its data (`corpus`,
`batches`; the shards are `eqx_gpt.data`'s), one optimiser step (`train_step`), the schedule and
time plan (`schedule`), evaluation, the run and its directory (`run`, `run_dir`, `progress`) and
devices (`parallel`)."""

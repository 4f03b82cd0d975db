"""`packed-ss bench`: the paper's measurements (tokens, NFE, tokens/NFE, time/NFE,
throughput, the model / non-model time split, accuracy, paired bootstrap intervals) for
chosen schedules on one task. `harness` is the command (`main`): `plan` parses and checks
the command line before any weights are read, `measure` decodes and times, `report`
summarises, prints and plots (and redraws a saved run). `tasks` loads prompts, `scoring`
judges answers, `stats` holds the bootstrap and accuracy statistics, `timing` the
model-time split, `accounting` the adapter's row counts, `figures` the figures from saved
results, `provenance` the reproducibility record."""

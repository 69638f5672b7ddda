"""The run layer: `build` (the typed parts of a run), `loop` (the async loop of every backend),
`sync_loop` (the baseline), `records` (what the loops write) and `api` (`run`, `train`)."""

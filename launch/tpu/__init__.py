"""Cloud TPU VM slices: one command per host, with jax.distributed set up on each."""

"""SLURM: an sbatch job of one task per node, with jax.distributed set up in each task."""

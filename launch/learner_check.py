"""One learner update as a multi-process SPMD program: the check a cluster launch runs first.

Every process builds the same tiny policy and the same batch of GRPO groups (both from a seed),
joins `jax.distributed`, puts them on one global mesh over all processes' devices and runs the
learner's jitted update (`learner/step.py`) once. Process 0 writes the updated parameters and
the update's loss to `--out` (.npz), so the result can be compared with a one-process update.

    python -m launch.learner_check --out /tmp/check.npz                        # one process
    JAX_COORDINATOR_ADDRESS=host0:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 \
        python -m launch.learner_check --mesh 1,-1,2 --out /tmp/check.npz       # each host
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from jaxrl_async import distributed
from jaxrl_async.sharding import MeshShape

GROUP_SIZE = 4
NUM_GROUPS = 4
ROW_LENGTH = 32


def check_groups(seed: int):
  """NUM_GROUPS groups of GROUP_SIZE samples with random tokens, logprobs and rewards."""
  from jaxrl_async.types import Sample
  rng = np.random.default_rng(seed)
  groups = []
  for g in range(NUM_GROUPS):
    group = []
    for i in range(GROUP_SIZE):
      prompt_len, response_len = int(rng.integers(2, 8)), int(rng.integers(1, 12))
      group.append(Sample(
          prompt_id=g, group_id=g, group_size=GROUP_SIZE,
          prompt_tokens=rng.integers(1, 15, prompt_len).astype(np.int32),
          response_tokens=rng.integers(1, 15, response_len).astype(np.int32),
          behaviour_logprobs=-rng.uniform(1.5, 3.5, response_len).astype(np.float32),
          token_versions=np.zeros(response_len, np.int32), reward=float(rng.integers(0, 2)),
          meta={"index_in_group": i}))
    groups.append(group)
  return groups


def initial_params(seed: int = 0):
  """(graphdef, params as numpy, logical axes) of the tiny policy, the same on every process."""
  import jax

  from jaxrl_async.model import get_config, init_model, param_logical_axes, split_model
  model = init_model(get_config("tiny", max_seq_len=ROW_LENGTH), seed=seed)
  graphdef, params = split_model(model)
  return graphdef, jax.device_get(params), param_logical_axes(model)


def run_update(mesh, seed: int = 0) -> tuple[dict, float]:
  """One update on `mesh` (any mesh: one device, one process, or spanning processes).

  Returns (updated params as numpy on every process, loss).
  """
  import jax

  from jaxrl_async import sharding
  from jaxrl_async.learner import step as step_lib
  from jaxrl_async.learner.batching import pack

  graphdef, host_params, logical_axes = initial_params(seed)
  config = step_lib.LearnerConfig(use_rollout_log_probs=True)
  params = distributed.to_global(host_params,
                                 sharding.param_shardings(logical_axes, host_params, mesh))
  state = step_lib.init_train_state(params, config.optimizer(), mesh, logical_axes)
  update = step_lib.make_update_fn(graphdef, config, GROUP_SIZE, step_lib.state_shardings(state))
  batch = pack(check_groups(seed), ROW_LENGTH, row_multiple=mesh.size)
  batch = distributed.to_global(batch, jax.tree.map(
      lambda x: sharding.batch_sharding(mesh, x.shape), batch))
  state, metrics = update(state, batch, None, np.float32(0), np.float32(0))
  return distributed.to_host(state.params), float(distributed.to_host(metrics["loss"]))


def flatten(params) -> dict[str, np.ndarray]:
  import jax
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def parse_mesh(text: str) -> MeshShape:
  try:
    data, fsdp, tensor = (int(x) for x in text.split(","))
  except ValueError:
    raise ValueError(f"--mesh must be 'data,fsdp,tensor' (ints, one may be -1), got {text!r}") from None
  return MeshShape(data=data, fsdp=fsdp, tensor=tensor)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m launch.learner_check", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--coordinator_address", default=None, help="host:port of process 0")
  parser.add_argument("--num_processes", type=int, default=None)
  parser.add_argument("--process_id", type=int, default=None)
  parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes (-1: the rest)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--init_timeout_s", type=int, default=120)
  parser.add_argument("--out", default=None, help=".npz for the updated params (process 0)")
  args = parser.parse_args(argv)
  try:
    spec = distributed.cluster_spec(args.coordinator_address, args.num_processes,
                                    args.process_id)
    shape = parse_mesh(args.mesh)
  except ValueError as error:
    print(f"learner_check: configuration error: {error}", file=sys.stderr)
    return 2
  distributed.initialize(spec, timeout_s=args.init_timeout_s)
  try:
    import jax
    mesh = distributed.global_mesh(shape)
    params, loss = run_update(mesh, args.seed)
    if jax.process_index() == 0 and args.out:
      np.savez(args.out, loss=np.float32(loss), **flatten(params))
    print(json.dumps({"process_id": jax.process_index(), "num_processes": jax.process_count(),
                      "global_devices": len(jax.devices()),
                      "local_devices": len(jax.local_devices()),
                      "mesh": dict(mesh.shape), "loss": loss, "source": spec.source,
                      "role": os.environ.get("JAXRL_ROLE", "")}),
          flush=True)
  finally:
    distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())

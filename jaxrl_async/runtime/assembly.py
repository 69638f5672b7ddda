"""The rollout side of a run, built in the process that runs it: task, engine, reward pool and
this server's shard of the prompts; and the rollout end of the weight channel.

The learner's process builds the learner side (`controller.build`); a rollout server builds only
what generation needs, from the same `RunConfig`, so both sides agree on the model and task.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import grain
import jax

from jaxrl_async.tasks import prompts as prompts_lib

# The weight channel between processes, by `RunConfig.sync_backend`: 'device' (the fast path of
# one host) becomes shared memory, 'store' stays the orbax store on a shared directory.
PROCESS_CHANNELS = {"device": "shm", "store": "store"}


def shard_prompt_dataset(task, *, seed: int, shard_index: int, shard_count: int,
                         epoch_size: int = prompts_lib.DEFAULT_EPOCH_SIZE) -> grain.IterDataset:
  """Shard `shard_index` of the training prompts: every `shard_count`-th index of the shuffled
  epoch, so shards are disjoint and together are the whole epoch (shard 0 of 1 is the
  pipeline of `prompts.prompt_dataset`)."""
  if not isinstance(shard_count, int) or shard_count < 1:
    raise ValueError(f"shard_count must be an int >= 1, got {shard_count!r}")
  if not isinstance(shard_index, int) or not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be an int in [0, {shard_count}), got {shard_index!r}")
  if shard_count == 1:
    return prompts_lib.prompt_dataset(task, seed=seed)
  if getattr(task, "prompt_dataset", None) is not None:
    raise ValueError(f"{type(task).__name__} makes its own prompt pipeline: give each rollout "
                     "server its shard through the task (shard_index, shard_count) and use "
                     "num_rollout_servers=1")
  indices = grain.MapDataset.range(int(epoch_size)).shuffle(seed=int(seed))
  indices = indices[shard_index::shard_count]
  problems = indices.map(prompts_lib._ProblemAt(task, "train")).repeat(None)
  return problems.to_iter_dataset(prompts_lib.default_read_options())


@dataclasses.dataclass
class RolloutSide:
  config: Any
  task: Any
  model_config: Any
  graphdef: Any
  logical_axes: Any
  engine: Any
  rewards: Any
  prompts: Any
  eval_problems: list

  def new_batcher(self):
    from jaxrl_async.rollout.generation import task_batcher
    return task_batcher(self.engine, self.task)

  def make_requests(self, problem, group_id: int, members):
    from jaxrl_async.controller import make_group_requests
    return make_group_requests(problem, group_id, self.config.group_size, self.config.seed,
                               members)


def model_parts(config):
  """(task, model config, graphdef, logical axes, abstract params) of a run's config."""
  from jaxrl_async.model import get_config, init_model, param_logical_axes, split_model
  from jaxrl_async.tasks.reverse import DigitReverseTask
  task = config.task if config.task is not None else DigitReverseTask(config.seed)
  cache_length = config.cache_length or task.max_sequence_len
  if getattr(config, "checkpoint", None) is not None:  # a Hugging Face checkpoint's shapes
    from jaxrl_async.controller import checkpoint_model_config
    model_config = checkpoint_model_config(config.checkpoint, task, cache_length)
  else:
    model_config = get_config(config.model, vocab_size=task.tokenizer.vocab_size,
                              max_seq_len=cache_length)
  model = jax.eval_shape(functools.partial(init_model, model_config))
  graphdef, abstract = split_model(model)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
  return task, model_config, graphdef, param_logical_axes(model), abstract


def build_rollout_side(config, shard_index: int, shard_count: int) -> RolloutSide:
  from jaxrl_async.rollout.engine import Engine
  from jaxrl_async.rollout.rewards import RewardPool
  task, model_config, graphdef, logical_axes, _ = model_parts(config)
  engine = Engine(graphdef, model_config, max_concurrent_decodes=config.max_concurrent_decodes,
                  max_prefill_length=task.max_sequence_len, sampling=config.sampling,
                  steps_per_call=config.decode_steps_per_call, logical_axes=logical_axes)
  rewards = RewardPool(task.reward, num_workers=config.reward_workers,
                       timeout_s=config.reward_timeout_s, max_retries=config.reward_retries)
  prompts = iter(shard_prompt_dataset(task, seed=config.seed, shard_index=shard_index,
                                      shard_count=shard_count))
  return RolloutSide(config=config, task=task, model_config=model_config, graphdef=graphdef,
                     logical_axes=logical_axes, engine=engine, rewards=rewards, prompts=prompts,
                     eval_problems=task.eval_set(config.eval_size))


def open_rollout_channel(spec: dict, config):
  """The rollout end of the channel the learner's process created (`spec` from it)."""
  from jaxrl_async.runtime.shm_channel import SharedMemoryWeightChannel
  from jaxrl_async.sync import OrbaxStoreChannel
  _, _, _, logical_axes, abstract = model_parts(config)
  if spec["kind"] == "shm":
    return SharedMemoryWeightChannel.attach(spec["location"], abstract)
  return OrbaxStoreChannel(spec["location"], abstract, logical_axes)

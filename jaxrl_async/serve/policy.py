"""The policy a server serves: a run's checkpoint (the learner's params at a saved version), or
an imported Hugging Face model directory (config.json, safetensors, tokenizer.json).

A Hugging Face directory without tokenizer.json (checkpoints often travel without one) is served
for prompts sent as token ids; a text prompt is refused with a message saying so. Its responses
end at the ids of generation_config.json's `eos_token_id`, else config.json's (none: only at the
response length limit).

A run whose `RunConfig.checkpoint` names a Hugging Face checkpoint (`model.weights.HFCheckpoint`)
is served with that model's architecture, its tokenizer (unless the run binds a task, whose
tokenizer it trained with) and its stop ids; before the run has saved a checkpoint, with the
Hugging Face weights themselves (policy_version 0).

A run directory holds `config.gin` (its operative config, read at the edge by `launch/serve.py`)
and `checkpoints/<policy_version>/` written by `jaxrl_async.checkpoint.RunCheckpointer`, whose
'state' item is {'step', 'params', 'opt_state'}. Only that item is read, onto one device.
"""

from __future__ import annotations

import os
import pathlib

import jax
import orbax.checkpoint as ocp

from jaxrl_async.config import RunConfig
from jaxrl_async.model import abstract_params, get_config
from jaxrl_async.model.hf_config import read_json_object
from jaxrl_async.serve.server import Policy
from jaxrl_async.tasks.reverse import DigitReverseTask


def checkpoint_dir(path: str | os.PathLike) -> str:
  """A run directory or its checkpoints/ folder -> the checkpoints/ folder (must exist)."""
  path = os.path.abspath(os.fspath(path))
  for candidate in (os.path.join(path, "checkpoints"), path):
    if os.path.isdir(candidate) and any(name.isdigit() for name in os.listdir(candidate)):
      return candidate
  raise FileNotFoundError(
      f"no checkpoint under {path!r}: expected a run directory with checkpoints/<version>/ "
      "or a checkpoints/ folder")


def run_dir_of(path: str | os.PathLike) -> str:
  """The run directory (the one with config.gin) of a run or checkpoints/ path."""
  path = os.path.abspath(os.fspath(path))
  for candidate in (path, os.path.dirname(path)):
    if os.path.isfile(os.path.join(candidate, "config.gin")):
      return candidate
  raise FileNotFoundError(f"no config.gin in {path!r} or its parent: is it a run directory?")


def _saved_steps(path) -> bool:
  path = os.path.abspath(os.fspath(path))
  return any(os.path.isdir(p) and any(name.isdigit() for name in os.listdir(p))
             for p in (os.path.join(path, "checkpoints"), path))


def _run_model(config: RunConfig):
  """(task, tokenizer, model_config) of a run: its model preset, or its HF checkpoint's model."""
  if config.checkpoint is None:
    task = config.task if config.task is not None else DigitReverseTask(config.seed)
    cache_length = config.cache_length or task.max_sequence_len
    return task, task.tokenizer, get_config(config.model, vocab_size=task.tokenizer.vocab_size,
                                            max_seq_len=cache_length)
  from jaxrl_async.run import build as build_lib
  from jaxrl_async.tasks.hf_tokenizer import HFTokenizer
  task = config.task if config.task is not None else DigitReverseTask(config.seed)
  tokenizer = (task.tokenizer if config.task is not None
               else HFTokenizer.from_dir(config.checkpoint.path))
  cache_length = config.cache_length or task.max_sequence_len
  model_config = build_lib.checkpoint_model_config(config.checkpoint, task, cache_length)
  return task, tokenizer, model_config


def policy_from_checkpoint(config: RunConfig, path: str | os.PathLike,
                           step: int | None = None) -> Policy:
  """Load the learner params of a run's checkpoint (the latest unless `step`) as a Policy.

  With `config.checkpoint` (an HFCheckpoint): the model is the checkpoint's, and a run with no
  saved checkpoint yet (and no `step` asked for) serves the Hugging Face weights.
  """
  task, tokenizer, model_config = _run_model(config)
  stop_ids = tuple(getattr(tokenizer, "stop_ids", ()))
  if config.checkpoint is not None and step is None and not _saved_steps(path):
    graphdef, _, _ = abstract_params(model_config)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = config.checkpoint.load(model_config)
    params = jax.device_put(params, device)
    return Policy(graphdef=graphdef, params=params, model_config=model_config,
                  tokenizer=tokenizer, eos_id=tokenizer.eos_id, stop_ids=stop_ids,
                  max_prefill_length=task.max_prompt_len,
                  max_response_len=task.max_response_len, version=0,
                  description=f"{config.checkpoint.path} (Hugging Face; the run has saved no "
                              "checkpoint yet)")
  directory = checkpoint_dir(path)
  graphdef, params, _ = abstract_params(model_config)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  tree = {"step": jax.ShapeDtypeStruct((), "int32"), "params": params,
          "opt_state": jax.eval_shape(config.learner.optimizer().init, params)}
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
  manager = ocp.CheckpointManager(directory, item_names=("state", "prompts", "run"))
  try:
    step = manager.latest_step() if step is None else step
    if step is None or step not in manager.all_steps():
      raise FileNotFoundError(f"checkpoint step {step} not in {directory} (saved steps: "
                              f"{sorted(manager.all_steps())})")
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))
  finally:
    manager.close()
  return Policy(graphdef=graphdef, params=restored["state"]["params"],
                model_config=model_config, tokenizer=tokenizer,
                eos_id=tokenizer.eos_id, stop_ids=stop_ids,
                max_prefill_length=task.max_prompt_len,
                max_response_len=task.max_response_len, version=int(step),
                description=f"{directory} at policy_version {step}")


def checkpoint_stop_ids(directory: str | os.PathLike, vocab_size: int) -> tuple[int, ...]:
  """The ids that end a generation by a Hugging Face directory's own files, as transformers reads
  them: generation_config.json's `eos_token_id` (an int or a list), else config.json's; () when
  neither names one."""
  directory = pathlib.Path(directory)
  for name in ("generation_config.json", "config.json"):
    source = read_json_object(directory / name)
    if "eos_token_id" in source:
      break
  value = source.get("eos_token_id")
  values = [] if value is None else value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size
             for v in values):
    raise ValueError(f"eos_token_id in {directory / name} must be an int in [0, vocab_size="
                     f"{vocab_size}) or a list of them, got {value!r}")
  return tuple(dict.fromkeys(values))


def policy_from_hf(directory: str | os.PathLike, *, max_seq_len: int | None = None,
                   max_prompt_len: int | None = None, dtype: str = "float32") -> Policy:
  """A Hugging Face model directory as a Policy (`model/weights.py`; tokenizer.json read with
  the `hf` extra). max_seq_len: the KV cache length (default the model's
  max_position_embeddings); max_prompt_len: the longest prompt (default half of it); responses
  take the rest of the cache. Without tokenizer.json the policy has no tokenizer (token ids
  only) and stops at `checkpoint_stop_ids`."""
  from jaxrl_async.model import weights
  model_config = weights.load_config(directory, max_seq_len=max_seq_len, dtype=dtype)
  cache_length = model_config.max_seq_len
  max_prompt_len = cache_length // 2 if max_prompt_len is None else max_prompt_len
  if not 1 <= max_prompt_len < cache_length:
    raise ValueError(f"max_prompt_len must be in [1, max_seq_len={cache_length}), got "
                     f"{max_prompt_len}")
  path = pathlib.Path(os.path.abspath(os.fspath(directory)))
  no_tokenizer_reason = ""
  if (path / "tokenizer.json").exists():
    from jaxrl_async.tasks.hf_tokenizer import HFTokenizer
    tokenizer = HFTokenizer.from_dir(path)
    eos_id, stop_ids = tokenizer.eos_id, tuple(tokenizer.stop_ids)
    description = f"{path} (Hugging Face)"
  else:
    tokenizer = None
    stop_ids = checkpoint_stop_ids(path, model_config.vocab_size)
    eos_id = stop_ids[0] if stop_ids else -1  # -1: no end token
    no_tokenizer_reason = f"the checkpoint at {path} has no tokenizer.json"
    if (path / "tokenizer.model").exists():
      no_tokenizer_reason += " (its tokenizer.model is not read)"
    description = f"{path} (Hugging Face; no tokenizer.json: prompts as token ids only)"
  graphdef, _, _ = abstract_params(model_config)
  params = weights.load_params(path, model_config)
  return Policy(graphdef=graphdef, params=params, model_config=model_config,
                tokenizer=tokenizer, eos_id=eos_id, stop_ids=stop_ids,
                max_prefill_length=max_prompt_len,
                max_response_len=cache_length - max_prompt_len, description=description,
                no_tokenizer_reason=no_tokenizer_reason)

"""RunConfig: every knob of a run, validated at start with the knob's name and allowed range.

Knob names and meanings follow verl (docs/knobs.md):
  N = mini_batch_size * require_batches * trigger_parameter_sync_step groups per policy version.
One local update is one optimizer step on `require_batches` mini-batches of `mini_batch_size`
groups; `trigger_parameter_sync_step` local updates make one policy version.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxrl_async.buffer.admission import admission_budget
from jaxrl_async.buffer.errors import check_version_gap_policy
from jaxrl_async.buffer.groups import drop_uniform_reward
from jaxrl_async.buffer.staleness_control import CONTROLLERS
from jaxrl_async.config_types import check_field_types
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.learner.step import LearnerConfig
from jaxrl_async.rollout.generation import PARTIAL_STRATEGIES
from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.sharding import MeshShape

MODES = ("sync", "on_policy", "stream_off_policy", "async_stale", "async_partial")
SYNC_BACKENDS = ("device", "store")
RAY_BUFFERS = ("driver", "actor")
BACKENDS = ("threads", "processes", "ray")
METRIC_SINKS = ("tensorboard", "wandb")
GROUP_FILTERS = (None, "uniform_reward")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  mode: str = "sync"
  seed: int = 0
  task: Any = None  # a Task; None = the built-in DigitReverseTask(seed)
  model: str = "tiny"
  # A model.weights.HFCheckpoint: the model and its initial weights from a Hugging Face
  # directory (then `model` and the warm start are not used); None = `model` + warm start.
  checkpoint: Any = None
  cache_length: int | None = None  # KV cache / sequence length; None = the task's longest
  # -- batch geometry --
  group_size: int = 8
  mini_batch_size: int = 8
  require_batches: int = 1
  trigger_parameter_sync_step: int = 1
  total_samples: int = 20_480  # the run's budget of consumed samples
  # -- freshness --
  staleness_threshold: float = 0.0
  max_version_gap: int | None = None
  # 'drop': groups older than max_version_gap are dropped as stale; 'wait': a take first waits
  # for the groups about to pass the bound (no bias against long responses; docs/knobs.md).
  version_gap_policy: str = "drop"
  partial_rollout: bool = False
  partial_strategy: str = "reprefill"
  # -- adaptive staleness (buffer/staleness_control.py): 'fixed' keeps s; 'adaptive' moves it
  # within [staleness_min, staleness_max] by staleness_step once per staleness_window_versions
  # versions, to keep the learner's idle ratio under idle_target while the stale ratio and the
  # KL (algo/behaviour_kl) stay under their budgets (docs/knobs.md).
  staleness_controller: str = "fixed"
  staleness_window_versions: int = 10
  staleness_step: float = 0.25
  staleness_min: float = 0.0
  staleness_max: float = 2.0
  idle_target: float = 0.1
  # 1.0: no budget on the stale ratio. Whenever rollout overlaps the update most consumed
  # tokens are a version old (0.63 at s = 0.25 and 0.98 at s = 1.0 on the RLVR recipe), so the
  # share follows s itself; staleness_max bounds that, and kl_budget the drift it causes.
  stale_ratio_budget: float = 1.0
  kl_budget: float = 0.02
  staleness_hysteresis: float = 0.2
  # -- rollout --
  max_concurrent_decodes: int = 64
  decode_steps_per_call: int = 1
  sampling: SamplingConfig = SamplingConfig()
  reward_workers: int = 2
  reward_timeout_s: float = 10.0
  reward_retries: int = 1
  # -- learner --
  learner: LearnerConfig = LearnerConfig()
  warm_start: WarmStartConfig = WarmStartConfig()
  learner_mesh: MeshShape = MeshShape(data=1, fsdp=1, tensor=1)
  # Placement: a rollout mesh on devices disjoint from the learner's (None = the rollout side
  # uses the learner's devices); device ids index jax.devices() (None = learner first, then
  # rollout). See sharding.place_roles.
  rollout_mesh: MeshShape | None = None
  learner_device_ids: tuple[int, ...] | None = None
  rollout_device_ids: tuple[int, ...] | None = None
  pack_sequences: bool = True  # several samples per row in the update (no padding FLOPs)
  # Compile the update for every packed row count the run can meet before its clock starts,
  # not at the update that first meets one (learner/compiled.py).
  precompile_updates: bool = True
  # Run the rollout engine's programs at every prefill bucket once when the rollout side is
  # built, not at the decode step that first meets one (Engine.warm_up).
  precompile_rollout: bool = True
  sync_backend: str = "device"
  # -- the weight store (sync_backend='store'; docs/sync.md) --
  # Publish only the changed elements of each leaf against the previous version (lossless);
  # a full version every sync_full_every versions and whenever a rollout server asks for one.
  sync_delta: bool = False
  sync_full_every: int = 16
  # The dtype of the rollout side's weights (None: as the learner trains them), e.g.
  # 'bfloat16' as an inference engine holds them; the store casts at publish.
  rollout_param_dtype: str | None = None
  # A rollout server still loading a version after this long is replaced (processes, Ray).
  sync_load_deadline_s: float | None = 300.0
  # -- backend: the roles as threads of one process, or rollout servers as processes / Ray --
  backend: str = "threads"
  num_rollout_servers: int = 1  # rollout server processes ('processes') or actors ('ray')
  heartbeat_timeout_s: float = 10.0  # a rollout server silent this long is replaced
  # 'ray': custom resources naming the nodes of each side (None = any node), and what each
  # rollout actor asks Ray for.
  ray_learner_resource: str | None = None
  ray_rollout_resource: str | None = None
  ray_rollout_cpus: float = 1.0
  ray_rollout_gpus: float = 0.0
  # 'ray': where the run's buffer lives: 'driver' (the learner's process, served to the rollout
  # actors over the buffer service's socket transport) or 'actor' (a buffer actor, Ray calls).
  ray_buffer: str = "driver"
  # -- bookkeeping --
  eval_every_versions: int = 10
  eval_size: int = 256
  checkpoint_every_versions: int = 50
  buffer_capacity: int | None = None  # samples; None = enough for the admission budget
  debug_checks: bool = True  # assert the staleness invariants on every consumed batch
  drop_truncated: bool = False  # drop samples cut at the length limit (counted 'truncated')
  group_filter: str | None = None  # 'uniform_reward': drop groups with equal rewards (DAPO)
  # No policy version for this long: print every thread's stack, checkpoint if possible, exit 3.
  watchdog_timeout_s: float | None = 1800.0
  watchdog_startup_s: float | None = 3600.0  # the bound for the first version (compilation)
  # How long the watchdog lets its rescue (stop the roles, write a checkpoint) take before it
  # exits anyway; a large model's checkpoint may need more.
  watchdog_rescue_s: float = 60.0
  # Beside metrics.jsonl: 'tensorboard' (when tensorboardX is installed), 'wandb' (offline).
  metric_sinks: tuple[str, ...] = ("tensorboard",)
  # An async run writes its schedule (every update's groups, every sample's key, tokens,
  # versions and logprobs) to run_dir/schedule/, so `jaxrl-async replay` can replay it
  # (docs/replay.md).
  record_schedule: bool = True

  def __post_init__(self):
    check_field_types(self)
    _choice("mode", self.mode, MODES)
    _choice("group_filter", self.group_filter, GROUP_FILTERS)
    for name in ("watchdog_timeout_s", "watchdog_startup_s"):
      if getattr(self, name) is not None and not getattr(self, name) > 0:
        raise ValueError(f"{name} must be > 0 or None (off), got {getattr(self, name)}")
    if not self.watchdog_rescue_s > 0:
      raise ValueError(f"watchdog_rescue_s must be > 0, got {self.watchdog_rescue_s}")
    _choice("staleness_controller", self.staleness_controller, CONTROLLERS)
    _positive_int("staleness_window_versions", self.staleness_window_versions)
    if self.adaptive_staleness:
      _check_adaptive(self)
    if self.buffer_capacity is not None and self.buffer_capacity < self.min_capacity:
      largest = "staleness_max" if self.adaptive_staleness else "staleness_threshold"
      raise ValueError(
          f"buffer_capacity={self.buffer_capacity} must be >= group_size * floor((1 + "
          f"{largest}) * groups_per_version) = {self.group_size} * "
          f"{self.min_capacity // self.group_size} = {self.min_capacity} (or None): a smaller "
          "buffer can fill with partial groups and deadlock")
    _choice("partial_strategy", self.partial_strategy, PARTIAL_STRATEGIES)
    _choice("sync_backend", self.sync_backend, SYNC_BACKENDS)
    _check_store(self)
    _choice("backend", self.backend, BACKENDS)
    _positive_int("num_rollout_servers", self.num_rollout_servers)
    if self.backend == "ray":
      _check_ray(self)
    if not self.heartbeat_timeout_s > 0:
      raise ValueError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
    if self.backend != "threads" and self.mode == "sync":
      raise ValueError(f"backend={self.backend!r} runs the roles of the async modes apart; "
                       "mode='sync' is serial and runs in one process: use backend='threads'")
    if self.backend == "threads" and self.num_rollout_servers != 1:
      raise ValueError(f"num_rollout_servers={self.num_rollout_servers} needs backend "
                       "'processes' or 'ray' (backend='threads' runs one rollouter)")
    if isinstance(self.metric_sinks, str) or any(
        sink not in METRIC_SINKS for sink in self.metric_sinks):
      raise ValueError(f"metric_sinks must be a tuple of names from {METRIC_SINKS}, got "
                       f"{self.metric_sinks!r}")
    if self.group_size < 2:
      raise ValueError(
          f"group_size must be >= 2 (GRPO normalises rewards within a group), got "
          f"{self.group_size}")
    for name in ("mini_batch_size", "require_batches", "trigger_parameter_sync_step",
                 "max_concurrent_decodes", "decode_steps_per_call", "reward_workers",
                 "eval_every_versions", "eval_size", "checkpoint_every_versions"):
      _positive_int(name, getattr(self, name))
    if self.staleness_threshold < 0:
      raise ValueError(
          f"staleness_threshold must be >= 0 (0 = on-policy), got {self.staleness_threshold}")
    if self.max_version_gap is not None and self.max_version_gap < 0:
      raise ValueError(f"max_version_gap must be >= 0 or None, got {self.max_version_gap}")
    check_version_gap_policy(self.version_gap_policy, self.max_version_gap)
    if not self.reward_timeout_s > 0:
      raise ValueError(f"reward_timeout_s must be > 0, got {self.reward_timeout_s}")
    if self.reward_retries < 0:
      raise ValueError(f"reward_retries must be >= 0, got {self.reward_retries}")
    if self.total_samples < self.samples_per_version:
      raise ValueError(
          f"total_samples={self.total_samples} is less than one policy version's "
          f"{self.samples_per_version} samples (groups_per_version x group_size)")
    if self.mode == "sync" and (self.staleness_threshold or self.partial_rollout):
      raise ValueError("mode='sync' needs staleness_threshold=0 and partial_rollout=False")
    if self.mode in ("on_policy", "stream_off_policy") and self.staleness_threshold != 0:
      raise ValueError(f"mode={self.mode!r} needs staleness_threshold=0, got "
                       f"{self.staleness_threshold}")
    if self.partial_rollout and self.staleness_threshold == 0:
      raise ValueError("partial_rollout=True needs staleness_threshold > 0 (with s = 0 nothing "
                       "is in flight across a version boundary)")

  @property
  def adaptive_staleness(self) -> bool:
    return self.staleness_controller == "adaptive"

  @property
  def largest_staleness(self) -> float:
    """The largest s of the run: staleness_max when the controller may raise s."""
    return self.staleness_max if self.adaptive_staleness else self.staleness_threshold

  @property
  def asserts_on_policy(self) -> bool:
    """Every consumed token has version gap 0 (s = 0 for the whole run), so the learner may
    assert it."""
    return self.staleness_threshold == 0 and not self.adaptive_staleness

  @property
  def min_capacity(self) -> int:
    """Samples the buffer must hold: every group the largest admission budget lets start."""
    return self.group_size * admission_budget(self.largest_staleness, self.groups_per_version)

  @property
  def capacity(self) -> int:
    return self.buffer_capacity if self.buffer_capacity is not None else self.min_capacity

  @property
  def group_filter_fn(self):
    return drop_uniform_reward if self.group_filter == "uniform_reward" else None

  @property
  def groups_per_update(self) -> int:
    return self.mini_batch_size * self.require_batches

  @property
  def groups_per_version(self) -> int:
    return self.groups_per_update * self.trigger_parameter_sync_step

  @property
  def samples_per_version(self) -> int:
    return self.groups_per_version * self.group_size

  @property
  def overlap_room(self) -> float:
    """Of the next update's groups, the share that can be made before a publish:
    floor(s N) / groups_per_update (at most floor(s N) groups beyond a version's N start before
    it is published). Below 1 the learner waits at every publish for the rest while the
    Rollouter makes them: the two roles take turns (docs/knobs.md)."""
    return (int(self.staleness_threshold * self.groups_per_version + 1e-9)
            / self.groups_per_update)

  @property
  def num_versions(self) -> int:
    return self.total_samples // self.samples_per_version

  @property
  def needs_window_params(self) -> bool:
    """'recompute' needs the window's weights kept beside the learner's only when a window has
    more than one update (its first update takes the anchor from its own forward pass)."""
    return self.learner.needs_recompute and self.trigger_parameter_sync_step > 1

  @property
  def is_async(self) -> bool:
    return self.mode != "sync"


ADAPTIVE_MODES = ("async_stale", "async_partial")
ROLLOUT_PARAM_DTYPES = (None, "float32", "bfloat16", "float16")


def _check_store(config) -> None:
  """The weight store's knobs: they act only through sync_backend='store'."""
  _choice("rollout_param_dtype", config.rollout_param_dtype, ROLLOUT_PARAM_DTYPES)
  _positive_int("sync_full_every", config.sync_full_every)
  deadline = config.sync_load_deadline_s
  if deadline is not None and not deadline > 0:
    raise ValueError(f"sync_load_deadline_s must be > 0 or None (off), got {deadline}")
  for name, value, off in (("sync_delta", config.sync_delta, False),
                           ("rollout_param_dtype", config.rollout_param_dtype, None)):
    if value != off and config.sync_backend != "store":
      raise ValueError(f"{name}={value!r} needs sync_backend='store' (the weight store "
                       f"publishes deltas and casts for the rollout side), got "
                       f"sync_backend={config.sync_backend!r}")
  if config.rollout_param_dtype is not None and config.mode == "sync":
    raise ValueError(f"rollout_param_dtype={config.rollout_param_dtype!r} needs an async mode: "
                     "mode='sync' hands the learner's params to its engine directly")


def _check_adaptive(config) -> None:
  """staleness_controller='adaptive': a mode whose s may be > 0, and bounds that hold s."""
  if config.mode not in ADAPTIVE_MODES:
    raise ValueError(
        f"staleness_controller='adaptive' needs mode {ADAPTIVE_MODES[0]!r} or "
        f"{ADAPTIVE_MODES[1]!r}, got mode={config.mode!r}: that mode needs staleness_threshold "
        "= 0 for the whole run (use staleness_controller='fixed')")
  for name in ("staleness_threshold", "staleness_min", "staleness_max", "staleness_step",
               "idle_target", "stale_ratio_budget", "kl_budget", "staleness_hysteresis"):
    if not math.isfinite(getattr(config, name)):
      raise ValueError(f"{name} must be finite with staleness_controller='adaptive', got "
                       f"{getattr(config, name)}")
  low, s, high = config.staleness_min, config.staleness_threshold, config.staleness_max
  if not 0 <= low <= s <= high:
    raise ValueError(
        f"staleness_controller='adaptive' needs 0 <= staleness_min <= staleness_threshold <= "
        f"staleness_max (s starts at staleness_threshold and moves between the bounds), got "
        f"staleness_min={low}, staleness_threshold={s}, staleness_max={high}")
  if config.partial_rollout and low == 0:
    raise ValueError("partial_rollout=True needs staleness_min > 0 with staleness_controller="
                     "'adaptive' (with s = 0 nothing is in flight across a version boundary)")
  if not config.staleness_step > 0:
    raise ValueError(f"staleness_step must be > 0, got {config.staleness_step}")
  for name in ("idle_target", "stale_ratio_budget"):
    if not 0 <= getattr(config, name) <= 1:
      raise ValueError(f"{name} must be in [0, 1] (a ratio), got {getattr(config, name)}")
  if config.kl_budget < 0:
    raise ValueError(f"kl_budget must be >= 0, got {config.kl_budget}")
  if not 0 <= config.staleness_hysteresis < 1:
    raise ValueError(f"staleness_hysteresis must be in [0, 1) (the share of a budget below "
                     f"which s may rise again), got {config.staleness_hysteresis}")


def _check_ray(config) -> None:
  import importlib.util
  if importlib.util.find_spec("ray") is None:
    raise ValueError("backend='ray' needs Ray, an optional extra: pip install -e '.[ray]' "
                     "(or use backend='threads' or 'processes')")
  for name in ("ray_rollout_cpus", "ray_rollout_gpus"):
    if not getattr(config, name) >= 0:
      raise ValueError(f"{name} must be >= 0, got {getattr(config, name)}")
  _choice("ray_buffer", config.ray_buffer, RAY_BUFFERS)


def _choice(name: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _positive_int(name: str, value) -> None:
  if not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")

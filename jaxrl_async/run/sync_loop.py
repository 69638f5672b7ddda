"""The sync baseline's loop: rollout -> reward -> old logprob -> update -> push weights, in turn.

It runs on the parts `build.build` makes (the same engine, slot count and update as the async
modes), with the same buffer rules, ledger, checkpoints and metrics as the async loop
(`loop.py`); only the barriers differ. It always runs in one process, its fastest form.
"""

from __future__ import annotations

import os
import time

import jax

from jaxrl_async import faults
from jaxrl_async.learner.sync_schedule import (
  Admit,
  Generate,
  Publish,
  Score,
  Take,
  Train,
  advance,
  sync_schedule,
)
from jaxrl_async.ledger import LEDGER_FILE, SampleLedger, log_offsets, rewind_logs
from jaxrl_async.metrics import RoleTimer, staleness_metrics, sum_pairs
from jaxrl_async.run.build import (
  ADMISSION_TIMEOUT_S,
  Evaluator,
  Parts,
  buffer_for,
  copy_params,
  learner_update,
  make_group_requests,
  rollout_params,
  run_checkpointer,
  take_ready,
  window_copy,
)
from jaxrl_async.run.records import (
  eval_record,
  ledger_audit,
  progress_bar,
  reward_metrics,
  show_version,
  version_record,
)
from jaxrl_async.sinks import make_writer
from jaxrl_async.watchdog import Watchdog


def run_sync(parts: Parts, run_dir, *, resume: bool, progress: bool, log=print):
  """The baseline -> (summary, final learner state)."""
  cfg = parts.config
  rollout = parts.rollout
  prompts = rollout.prompts
  checkpointer = run_checkpointer(parts.learner, os.path.join(run_dir, "checkpoints"), log=log)
  buffer = buffer_for(cfg)
  batcher = rollout.new_batcher()
  state = parts.learner.initial_state
  version, next_group, consumed, tokens_consumed = 0, 0, 0, 0
  last_eval: dict[str, float] = {}
  evaluated = None  # the version last evaluated
  restored = checkpointer.restore_latest(state, prompts) if resume else None
  if resume and restored is None:
    log(f"resume: no checkpoint under {checkpointer.directory}; starting from scratch")
  rewind_logs(run_dir, restored[1] if restored is not None else None)
  if restored is not None:
    state, run_state, _ = restored
    version, next_group = run_state["policy_version"], run_state["next_group_id"]
    consumed, tokens_consumed = run_state["consumed_samples"], run_state["consumed_tokens"]
    buffer.set_state(run_state["buffer"])
    last_eval = dict(run_state.get("last_eval", {}))
    evaluated = run_state.get("evaluated_version")
  timer = RoleTimer()
  rollout.rewards.timer = timer  # reward scoring counts as the 'reward' role's busy time
  writer = make_writer(run_dir, timer, cfg.metric_sinks, log=log)
  evaluator = Evaluator(rollout, parts.learner)
  ledger = SampleLedger(os.path.join(run_dir, LEDGER_FILE))
  if restored is not None:
    timer.start -= run_state.get("wall_s", 0.0)
    log(f"resumed from {checkpointer.directory} at policy_version {version}")
  buffer.publish_version(version)
  window_params = window_copy(parts.learner, state.params) if cfg.needs_window_params else None
  batcher.set_params(copy_params(rollout_params(parts.learner, state.params)), version)
  bar = progress_bar(cfg.num_versions, version, progress)

  def run_state_now() -> dict:
    ledger.dropped_log(buffer.take_drop_log())
    return {"policy_version": version, "next_group_id": next_group,
            "consumed_samples": consumed, "consumed_tokens": tokens_consumed,
            "wall_s": timer.wall_s(), "buffer": buffer.get_state(),
            "rollout": {"backend": "sync"}, "last_eval": last_eval,
            "evaluated_version": evaluated, **log_offsets(run_dir, ledger)}

  def describe() -> str:
    return f"sync at policy_version {version}, buffer {buffer.counts}"

  boundary = None
  watchdog = Watchdog(cfg.watchdog_timeout_s, startup_s=cfg.watchdog_startup_s,
                      rescue_s=cfg.watchdog_rescue_s,
                      describe=describe)
  try:
    with watchdog:
      # The order of the stages is `sync_schedule`'s (shared with the simulator); each
      # effect is performed here.
      schedule = sync_schedule(start_version=version, num_versions=cfg.num_versions,
                               groups_per_update=cfg.groups_per_update,
                               trigger=cfg.trigger_parameter_sync_step)
      effect, ready, accumulated = advance(schedule), [], {}
      while effect is not None:
        result = None
        match effect:
          case Admit(count=count):
            if version % cfg.eval_every_versions == 0 and evaluated != version:
              with timer.excluded():
                last_eval = evaluator(state.params, version)
              evaluated = version
              writer.write(eval_record(version, state, consumed, timer, last_eval))
            # Where this version starts: a Ctrl-C before its first update checkpoints this
            # point.
            boundary = (prompts.get_state(), next_group, state, run_state_now())
            requests = []
            for _ in range(count):
              buffer.acquire_group_slot(timeout=ADMISSION_TIMEOUT_S, group_id=next_group)
              requests += make_group_requests(next(prompts), next_group,
                                              cfg.group_size, cfg.seed)
              next_group += 1
          case Generate():
            with timer.busy("rollout"):
              samples = batcher.run_to_completion(requests)
          case Score():
            for sample in rollout.rewards.score_all(samples):
              buffer.put(sample, timeout=ADMISSION_TIMEOUT_S)
            ready = take_ready(buffer, version)
            if cfg.debug_checks:
              gap = staleness_metrics(ready, version)["algo/version_gap_max"]
              assert gap == 0, f"sync mode consumed a token with version gap {gap}"
            accumulated = {}
          case Take(count=count):
            # After drops a chunk may be short: it trains as it is (padded with empty rows).
            result, ready = ready[:count], ready[count:]
          case Train(groups=chunk, local=local):
            with timer.busy("learner"):
              state, metrics = learner_update(parts.learner, state, chunk, window_params,
                                              version, local)
              accumulated = sum_pairs(accumulated, jax.device_get(metrics))
          case Publish(version=new_version, consumed=groups):
            consumed += sum(len(g) for g in groups)
            tokens_consumed += sum(s.num_response_tokens for g in groups for s in g)
            faults.point("sync.publish")
            with timer.busy("sync"):
              began = time.perf_counter()
              window_params = (window_copy(parts.learner, state.params)
                               if cfg.needs_window_params else None)
              batcher.set_params(copy_params(rollout_params(parts.learner, state.params)),
                                 new_version)
              jax.block_until_ready(batcher.params)
              sync_latency = time.perf_counter() - began
            version = new_version
            buffer.publish_version(version)
            watchdog.progress()
            ledger.consumed(version, groups)
            record = version_record(cfg, timer, version, state, groups, accumulated, consumed,
                                    tokens_consumed, sync_latency)
            record.update(buffer.metrics())
            record.update(reward_metrics(rollout.rewards))
            writer.write(record)
            show_version(bar, record, last_eval, gap=False)
            if version % cfg.checkpoint_every_versions == 0 or version == cfg.num_versions:
              with timer.excluded():
                checkpointer.save(version, state, prompts, run_state_now())
              watchdog.progress()  # a checkpoint that finished is progress too
        effect = advance(schedule, result)
      if evaluated != version:
        with timer.excluded():
          last_eval = evaluator(state.params, version)
        evaluated = version
        writer.write(eval_record(version, state, consumed, timer, last_eval))
  except KeyboardInterrupt:
    # Nothing of this version was trained yet (the update donates the old state, so a
    # deleted boundary state means an update ran): rewind the prompts and save the boundary.
    if boundary is not None and not _deleted(boundary[2]):
      prompts.set_state(boundary[0])
      next_group, state = boundary[1], boundary[2]
      checkpointer.save(version, state, prompts, boundary[3])
      log(f"interrupted: checkpoint at policy_version {version} in {checkpointer.directory}")
    raise
  finally:
    bar.close()
    writer.close()
    checkpointer.close()
  ledger.dropped_log(buffer.take_drop_log())
  buffer.check_invariants()
  audit_figures = ledger_audit(ledger, cfg.group_size, next_group_id=next_group)
  ledger.close()
  summary = {**timer.summary(), **last_eval, **buffer.metrics(),
             **reward_metrics(rollout.rewards), **audit_figures, "mode": cfg.mode,
             "backend": "sync", "policy_version": version, "learner_step": int(state.step),
             "consumed_samples": consumed,
             "system/samples_per_s": consumed / max(timer.wall_s(), 1e-9),
             "rollout/next_group_id": next_group, "rollout/produced_groups": next_group,
             "run_dir": os.path.abspath(run_dir), "checkpoint_dir": checkpointer.directory}
  return summary, state


def _deleted(state) -> bool:
  return any(x.is_deleted() for x in jax.tree.leaves(state.params))

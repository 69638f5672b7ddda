"""Group ids and prompts of a fleet whose number of rollout servers changes: on a resume with
another `num_rollout_servers`, or when servers are added or retired during a run.

Group ids. In one life of a fleet of K servers, server k numbers its groups s_k, s_k + K,
s_k + 2K, ... from its start s_k (k on a fresh run). A segment `[first, stride, end]` is the ids
`range(first, end, stride)` one server slot drew; the run's produced groups are the union of
its segments: those of fleet shapes that ended (`closed`) and the current servers' (start, K,
next group id). When the count changes, every current segment is closed and server k' of K'
starts at B + k', B being the largest end of all segments (above every id ever drawn), so ids
never collide whatever the counts were. A checkpoint keeps the segments
(`run_state['rollout']['segments']`); one without them (older) had starts 0 .. K - 1.

Prompts are re-dealt from where the union of the old shares stopped
(`tasks.prompt_stream.redeal_prompts`), and the old servers' unfinished groups (from the
checkpoint's snapshots, or revoked from the buffer service) are dealt round robin to the new
servers, which re-issue each exactly once under its old group id (inside a closed segment).
"""

from __future__ import annotations

import dataclasses

from jaxrl_async.tasks.prompt_stream import redeal_prompts


def group_ids(segments: list) -> list[int]:
  """Every group id of `segments` (each `[first, stride, end]`), sorted."""
  ids = set()
  for first, stride, end in segments:
    ids.update(range(int(first), int(end), int(stride)))
  return sorted(ids)


def close(closed: list, starts: list[int], nexts: list[int]) -> list:
  """`closed` and the current servers' segments (start, stride len(starts), next id); a
  segment that continues a closed one (same stride, starting at its end) extends it."""
  out = [list(segment) for segment in closed]
  stride = len(starts)
  for start, end in zip(starts, nexts, strict=True):
    if end < start:
      raise ValueError(f"a server's next group id {end} is below its start {start}")
    joined = next((s for s in out if s[1] == stride and s[2] == start), None)
    if joined is not None:
      joined[2] = int(end)
    elif end > start:
      out.append([int(start), stride, int(end)])
  return out


def checkpoint_segments(rollout: dict) -> list:
  """The group-id segments a checkpoint's `run_state['rollout']` recorded (older checkpoints:
  server k of K started at k)."""
  servers = rollout["servers"]
  if "segments" in rollout:
    return [list(segment) for segment in rollout["segments"]]
  return close([], list(range(len(servers))), [s["next_group_id"] for s in servers])


def id_base(segments: list) -> int:
  """Above every group id of `segments`: where a new fleet shape's ids start."""
  return max((int(end) for _, _, end in segments), default=0)


def redeal(servers: list[dict], count: int, base: int) -> list[dict]:
  """What each of `count` new servers starts from, given every old server's
  `{'rollout': {'inflight': [...], ...}, 'prompts': state}` (in old server order): a share of
  the prompts nobody drew, a share of the unfinished groups, and group ids from `base + k`."""
  shares = redeal_prompts([server.get("prompts") for server in servers], count)
  inflight = sorted((entry for server in servers
                     for entry in (server.get("rollout") or {}).get("inflight", [])),
                    key=lambda entry: int(entry["group_id"]))
  ids = [int(entry["group_id"]) for entry in inflight]
  if len(set(ids)) != len(ids):
    raise ValueError(f"unfinished groups held by two servers: {sorted(ids)}")
  if ids and max(ids) >= base:
    raise ValueError(f"unfinished group {max(ids)} lies at or above the new ids' base {base}")
  return [{"rollout": {"next_group_id": base + k, "inflight": inflight[k::count]},
           "prompts": shares[k]} for k in range(count)]


def resized_restores(rollout: dict, prompts: list, count: int) -> tuple[list[dict], list,
                                                                        list[int]]:
  """(restores, closed segments, starts) of `count` servers from a checkpoint's rollout run
  state and per-server prompt states: the saved servers' own restores when the count is the
  same, a re-deal otherwise."""
  servers = rollout["servers"]
  if len(prompts) != len(servers):
    raise ValueError(f"the checkpoint holds {len(servers)} servers' rollout states but "
                     f"{len(prompts)} prompt states")
  segments = checkpoint_segments(rollout)
  restores = [{"rollout": server, "prompts": state}
              for server, state in zip(servers, prompts, strict=True)]
  if len(servers) == count:
    return restores, segments, [int(server["next_group_id"]) for server in servers]
  base = id_base(segments)
  return redeal(restores, count, base), segments, [base + k for k in range(count)]


# ---- a change of shape during a run (an elastic fleet) --------------------------------------
RESHAPE_REASONS = ("server_retired", "fleet_resized")


@dataclasses.dataclass(frozen=True)
class NewShape:
  """A fleet shape dealt from the old servers' work: each new server's restore, the group-id
  segments of the shapes that ended, the new servers' first group ids, the re-issues counted."""

  restores: list[dict]
  closed_segments: list
  group_starts: list[int]
  reissued: dict[str, int]


def zero_counts() -> dict[str, int]:
  """The elastic fleet's counts before any change of shape (reported from the start)."""
  counts = {f"runtime/reissued_{kind}/{reason}": 0
            for kind in ("groups", "samples") for reason in RESHAPE_REASONS}
  return {**counts, "fleet/adds": 0, "fleet/retires": 0}


def reissue_counts(orphans: list[dict], retires: list[int]) -> dict[str, int]:
  """The groups and samples the old servers left unfinished (`orphans`, in old server order),
  by reason: 'server_retired' for the servers in `retires`, 'fleet_resized' for the others."""
  counts = {key: value for key, value in zero_counts().items() if key.startswith("runtime/")}
  for index, orphan in enumerate(orphans):
    reason = "server_retired" if index in retires else "fleet_resized"
    inflight = orphan["rollout"]["inflight"]
    counts[f"runtime/reissued_groups/{reason}"] += len(inflight)
    counts[f"runtime/reissued_samples/{reason}"] += sum(len(e["missing"]) for e in inflight)
  return counts


def orphan(revoked: dict, initial: dict) -> dict:
  """A leaving server's work as `new_shape` deals it: `revoked` (the buffer's record of its
  client: `inflight`, `next_group_id`, `prompt_state`), where it started (`initial`:
  `next_group_id`, `prompts`) standing in for what a server that never drew did not record."""
  return {"rollout": {"inflight": revoked["inflight"],
                      "next_group_id": (revoked["next_group_id"]
                                        if revoked["next_group_id"] is not None
                                        else initial["next_group_id"])},
          "prompts": (revoked["prompt_state"] if revoked["prompt_state"] is not None
                      else initial["prompts"])}


def new_shape(orphans: list[dict], retires: list[int], closed: list, starts: list[int],
              count: int) -> NewShape:
  """`count` servers' shape from the old ones' `orphans` (each `{'rollout': {'inflight',
  'next_group_id'}, 'prompts'}`: unfinished groups, next group id, prompt position; old server
  order), the segments of shapes that ended (`closed`) and where the old servers' ids started
  (`starts`)."""
  nexts = [int(orphan["rollout"]["next_group_id"]) for orphan in orphans]
  segments = close(closed, starts, nexts)
  base = id_base(segments)
  return NewShape(restores=redeal(orphans, count, base), closed_segments=segments,
                  group_starts=[base + k for k in range(count)],
                  reissued=reissue_counts(orphans, retires))

"""A report comparing runs side by side: PNG figures and one HTML page.

    jaxrl-async report runs/sync runs/async_partial --out reports/modes

Reads each run directory's metrics.jsonl, summary.json and spans.jsonl (what `sinks` writes) and
draws, with matplotlib's Agg backend (`pip install -e '.[plot]'`):
  curves.png        held-out accuracy and training reward against wall-clock and against samples;
  timeline.png      each role's busy spans over a window of policy versions (a Gantt chart), with
                    each version's hand-off marked: the rollout's first work under it, its
                    first sample in the buffer and the learner's first take of one;
  version_gap.png   the share of consumed tokens per version gap;
  queue_depth.png   samples queued in the buffer against wall-clock;
  idle_ratios.png   each role's idle ratio over the whole run;
  overview.png      accuracy against wall-clock, samples/s and idle ratios in one figure;
  staleness.png     the staleness threshold s in force at each policy version, for runs with
                    an adaptive controller (`staleness/threshold`; only when a run has it);
and index.html, which shows them all below a table of each run's final figures.
Wall-clock everywhere is the run's own clock: evaluation and checkpoint time are excluded.
"""

from __future__ import annotations

import html
import os
import sys

from jaxrl_async.metrics import ROLES
from jaxrl_async.report_data import (  # noqa: F401  (the report's data, read as report.X too)
  HANDOFF_MARKS,
  TABLE,
  Run,
  gap_shares,
  handoff_marks,
  has_staleness,
  idle_ratio,
  load_run,
  mean,
  run_names,
  timeline_window,
)

FIGURES = ("overview", "curves", "timeline", "version_gap", "queue_depth", "idle_ratios")
ROLE_COLORS = {"rollout": "tab:blue", "reward": "tab:green", "learner": "tab:red",
               "sync": "tab:purple"}


# ---- figures --------------------------------------------------------------------------------
def _pyplot():
  try:
    import matplotlib
  except ImportError as error:
    raise ImportError("jaxrl-async report needs matplotlib (pip install -e '.[plot]')") from error
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


LONG_NAME = 20


def _legend(ax) -> None:
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)


def _save(plt, fig, runs, path) -> None:
  """Saves the figure; where runs go by numbers, a key of numbers and names goes below it."""
  if any(run.label != run.name for run in runs):
    fig.text(0.01, 0.0, "\n".join(f"{run.label}: {run.name}" for run in runs), va="top",
             fontsize=8, family="monospace")
  fig.savefig(path, dpi=100, bbox_inches="tight")
  plt.close(fig)


def plot_curves(plt, runs, path):
  fig, axes = plt.subplots(2, 2, figsize=(12, 8))
  for run in runs:
    if run.evals:
      axes[0, 0].plot([r["time_s"] for r in run.evals], [r["eval/accuracy"] for r in run.evals],
                      marker=".", label=run.label)
      axes[0, 1].plot([r["samples"] for r in run.evals], [r["eval/accuracy"] for r in run.evals],
                      marker=".", label=run.label)
    points = [r for r in run.versions if r.get("result/reward_mean") is not None]
    axes[1, 0].plot([r["time_s"] for r in points], [r["result/reward_mean"] for r in points],
                    label=run.label)
    axes[1, 1].plot([r["samples"] for r in points], [r["result/reward_mean"] for r in points],
                    label=run.label)
  for row, what in ((0, "held-out accuracy"), (1, "training reward")):
    axes[row, 0].set(xlabel="wall-clock s (eval excluded)", ylabel=what,
                     title=f"{what} vs wall-clock")
    axes[row, 1].set(xlabel="samples consumed", ylabel=what, title=f"{what} vs samples")
  for ax in axes.flat:
    ax.grid(alpha=0.3)
    _legend(ax)
  fig.tight_layout()
  _save(plt, fig, runs, path)


def plot_timeline(plt, runs, path, width):
  fig, axes = plt.subplots(len(runs), 1, figsize=(13, 2.2 + 1.6 * len(runs)), squeeze=False)
  for ax, run in zip(axes[:, 0], runs):
    window = timeline_window(run, width)
    if window is None:
      ax.text(0.5, 0.5, "no busy spans recorded", ha="center", va="center",
              transform=ax.transAxes)
      ax.set(title=run.name, yticks=[])
      continue
    boundaries = run.boundaries
    begin, end = boundaries[window[0]], boundaries[window[1]]
    for row, role in enumerate(ROLES):
      bars = [(max(s, begin), min(e, end) - max(s, begin)) for r, s, e in run.spans
              if r == role and e > begin and s < end]
      ax.broken_barh(bars, (row - 0.4, 0.8), color=ROLE_COLORS[role])
    marks = handoff_marks(run, window)
    for name, label, marker in HANDOFF_MARKS:
      if marks[name]:
        ax.plot(marks[name], [len(ROLES) - 0.5] * len(marks[name]), marker, color="black",
                ms=4, ls="none", label=f"hand-off: {label}")
    if any(marks.values()):
      ax.legend(loc="lower right", fontsize=7, ncol=3)
    for version in range(window[0], window[1] + 1):
      if version in boundaries:
        ax.axvline(boundaries[version], color="black", lw=0.8, ls="--")
        ax.text(boundaries[version], len(ROLES) - 0.45, f" v{version}", fontsize=8,
                va="bottom")
    ax.set(xlim=(begin, end), ylim=(-0.6, len(ROLES) - 0.1), yticks=range(len(ROLES)),
           yticklabels=ROLES, xlabel="wall-clock s (eval excluded)",
           title=f"{run.name}: busy spans, policy versions {window[0]} to {window[1]}")
    ax.invert_yaxis()
  fig.tight_layout()
  _save(plt, fig, runs, path)


def plot_version_gap(plt, runs, path):
  fig, ax = plt.subplots(figsize=(8, 4.5))
  shares = {run.label: gap_shares(run) for run in runs}
  longest = max((len(s) for s in shares.values()), default=0)
  width = 0.8 / max(len(runs), 1)
  for i, (name, share) in enumerate(shares.items()):
    ax.bar([gap + (i - (len(runs) - 1) / 2) * width for gap in range(len(share))], share,
           width, label=name)
  if longest == 0:
    ax.text(0.5, 0.5, "no version-gap counts recorded", ha="center", va="center",
            transform=ax.transAxes)
  ax.set_xticks(range(max(longest, 1)))
  ax.set(xlabel="version gap (learner version - token's version)",
         ylabel="share of consumed tokens", ylim=(0, 1.05),
         title="version-gap histogram (consumed tokens)")
  _legend(ax)
  fig.tight_layout()
  _save(plt, fig, runs, path)


def plot_queue_depth(plt, runs, path):
  fig, ax = plt.subplots(figsize=(8, 4.5))
  missing = []
  for run in runs:
    points = [r for r in run.versions if r.get("queue/depth") is not None]
    if points:
      ax.step([r["time_s"] for r in points], [r["queue/depth"] for r in points], where="post",
              label=run.label)
    else:
      missing.append(run.name)
  title = "queue depth at each policy version"
  if missing:
    title += f"\n(not recorded: {', '.join(missing)})"
  ax.set(xlabel="wall-clock s (eval excluded)", ylabel="samples queued", title=title)
  ax.grid(alpha=0.3)
  _legend(ax)
  fig.tight_layout()
  _save(plt, fig, runs, path)


def _idle_bars(ax, runs):
  width = 0.8 / len(ROLES)
  for i, role in enumerate(ROLES):
    ax.bar([j + (i - 1.5) * width for j in range(len(runs))],
           [idle_ratio(run, role) for run in runs], width, label=role, color=ROLE_COLORS[role])
  ax.set_xticks(range(len(runs)), [run.label for run in runs])
  ax.set(ylabel="idle ratio (whole run)", ylim=(0, 1.25), yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0],
         title="idle ratio per role")
  ax.legend(fontsize=8, ncols=len(ROLES), loc="upper center")


def plot_staleness(plt, runs, path):
  """s against the policy version (a step where the adaptive controller changed it)."""
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for run in runs:
    points = [r for r in run.versions if r.get("staleness/threshold") is not None]
    if points:
      ax.step([r["policy_version"] for r in points], [r["staleness/threshold"] for r in points],
              where="post", label=run.label)
  ax.set(xlabel="policy version", ylabel="staleness threshold s",
         title="staleness threshold in force (adaptive controller)")
  ax.grid(alpha=0.3)
  _legend(ax)
  fig.tight_layout()
  _save(plt, fig, runs, path)


def plot_idle_ratios(plt, runs, path):
  fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(runs) + 3), 4.5))
  _idle_bars(ax, runs)
  fig.tight_layout()
  _save(plt, fig, runs, path)


def plot_overview(plt, runs, path):
  fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
  for run in runs:
    axes[0].plot([r["time_s"] for r in run.evals], [r["eval/accuracy"] for r in run.evals],
                 marker=".", label=run.label)
  axes[0].set(xlabel="wall-clock s (eval excluded)", ylabel="held-out accuracy",
              title="accuracy vs wall-clock")
  axes[0].grid(alpha=0.3)
  _legend(axes[0])
  rates = [run.table_row()["system/samples_per_s"] or 0.0 for run in runs]
  axes[1].bar(range(len(runs)), rates, color="tab:gray")
  axes[1].set_xticks(range(len(runs)), [run.label for run in runs])
  axes[1].set(ylabel="samples/s", title="samples/s")
  _idle_bars(axes[2], runs)
  fig.tight_layout()
  _save(plt, fig, runs, path)


# ---- the page ---------------------------------------------------------------------------------
def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return html.escape("-" if value is None else str(value))


def _numbered(run: Run) -> str:
  return run.name if run.label == run.name else f"{run.label}: {run.name}"


def write_html(runs, out_dir, figures) -> str:
  header = "".join(f"<th>{html.escape(_numbered(run))}</th>" for run in runs)
  rows = []
  for key, label in TABLE:
    cells = "".join(f"<td>{_cell(run.table_row()[key])}</td>" for run in runs)
    rows.append(f"<tr><th>{html.escape(label)}</th>{cells}</tr>")
  paths = "".join(f"<li>{html.escape(_numbered(run))}: <code>{html.escape(os.path.abspath(run.path))}"
                  "</code></li>" for run in runs)
  images = "".join(
      f'<h2>{html.escape(name.replace("_", " "))}</h2><img src="{os.path.basename(file)}" '
      f'alt="{name}">' for name, file in figures.items())
  page = (
      "<!doctype html><html><head><meta charset='utf-8'><title>jaxrl_async report</title>"
      "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
      "td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}"
      "img{max-width:100%;border:1px solid #eee}</style></head><body>"
      f"<h1>jaxrl_async report: {len(runs)} run(s)</h1><ul>{paths}</ul>"
      f"<table><tr><th></th>{header}</tr>{''.join(rows)}</table>"
      "<p>Wall-clock is each run's own clock (evaluation and checkpoints excluded).</p>"
      f"{images}</body></html>")
  path = os.path.join(out_dir, "index.html")
  with open(path, "w", encoding="utf-8") as f:
    f.write(page)
  return path


def write_report(run_dirs, out_dir: str, *, names=None, timeline_versions: int = 4) -> dict:
  """Loads the runs, writes the figures and index.html to `out_dir`; returns name -> path."""
  if not run_dirs:
    raise ValueError("report needs at least one run directory")
  if timeline_versions < 1:
    raise ValueError(f"timeline_versions must be >= 1, got {timeline_versions}")
  names = names or run_names(run_dirs)
  runs = [load_run(path, name) for path, name in zip(run_dirs, names, strict=True)]
  numbered = any(len(run.name) > LONG_NAME for run in runs)
  for number, run in enumerate(runs, 1):
    run.label = str(number) if numbered else run.name
  plt = _pyplot()
  os.makedirs(out_dir, exist_ok=True)
  figures = {name: os.path.join(out_dir, f"{name}.png") for name in FIGURES}
  plot_overview(plt, runs, figures["overview"])
  plot_curves(plt, runs, figures["curves"])
  plot_timeline(plt, runs, figures["timeline"], timeline_versions)
  plot_version_gap(plt, runs, figures["version_gap"])
  plot_queue_depth(plt, runs, figures["queue_depth"])
  plot_idle_ratios(plt, runs, figures["idle_ratios"])
  if any(has_staleness(run) for run in runs):
    figures["staleness"] = os.path.join(out_dir, "staleness.png")
    plot_staleness(plt, runs, figures["staleness"])
  return {**figures, "html": write_html(runs, out_dir, figures)}


def default_out_dir(run_dirs) -> str:
  """One run: <run>/report; several: report/ in their common parent."""
  if len(run_dirs) == 1:
    return os.path.join(run_dirs[0], "report")
  parent = os.path.commonpath([os.path.abspath(p) for p in run_dirs])
  return os.path.join(parent, "report")


def main(argv=None) -> int:
  import argparse
  parser = argparse.ArgumentParser(prog="jaxrl-async report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  parser.add_argument("--out", default=None, help="output folder (default: see above)")
  parser.add_argument("--timeline_versions", type=int, default=4,
                      help="policy versions shown in the stage timeline")
  args = parser.parse_args(argv)
  try:
    paths = write_report(args.run_dirs, args.out or default_out_dir(args.run_dirs),
                         timeline_versions=args.timeline_versions)
  except (FileNotFoundError, ValueError, ImportError) as error:
    print(f"jaxrl-async report: {error}", file=sys.stderr)
    return 2
  print(f"report: {os.path.abspath(paths['html'])}")
  return 0

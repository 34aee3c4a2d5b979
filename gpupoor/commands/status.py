"""`gpupoor status`: a run's progress, its checkpoints (valid or why not), whether a process trains in it now,
and how to continue. Imports no torch."""

from __future__ import annotations

import math
import time
from pathlib import Path

from gpupoor.storage.checkpoint import final_problem, read_manifest, scan
from gpupoor.storage.rundir import METRICS, RunLock, read_session, stored_recipe
from gpupoor.train.metrics import read_metrics
from gpupoor.units import format_duration


SPARK_MARKS = "▁▂▃▄▅▆▇█"


def loss_sparkline(records: list[dict], width: int = 40) -> str | None:
    """`loss █▆▅▄▃▂▁ 6.002 -> 5.898 (steps 1-1200, 30 per mark)`: the step records' losses averaged into at
    most `width` marks, lowest ▁ to highest █; non-finite losses left out. None when there is no loss to show."""
    points = [(r["step"], r["loss"]) for r in records
              if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    if not points:
        return None
    count = min(width, len(points))
    # Bucket i holds points [i*n/count, (i+1)*n/count): sizes differ by at most one, every point used once.
    means = []
    for i in range(count):
        bucket = points[i * len(points) // count:(i + 1) * len(points) // count]
        means.append(sum(loss for _, loss in bucket) / len(bucket))
    low, high = min(means), max(means)
    top = len(SPARK_MARKS) - 1
    marks = "".join(SPARK_MARKS[round((m - low) / (high - low) * top) if high > low else top // 2] for m in means)
    first, last = points[0][0], points[-1][0]
    span = f"step {first}" if first == last else f"steps {first}-{last}"
    per = len(points) / count
    if per > 1:
        span += f", {per:.0f} per mark" if per == int(per) else f", ~{per:.1f} per mark"
    return f"loss {marks} {means[0]:.4g} -> {means[-1]:.4g} ({span})"


def _session_line(run_dir: Path, time_limit: str | None) -> str:
    budget = f"time limit {time_limit} per invocation" if time_limit else "no time limit"
    if not RunLock.held(run_dir):
        return f"  not running; {budget}"
    session = read_session(run_dir)
    if session is None:
        return "  running (starting up)"
    line = f"  running: pid {session['pid']}"
    if session["time_limit_s"]:
        left = session["started"] + session["time_limit_s"] - time.time()
        line += f", time limit left {format_duration(max(0.0, left), style='age')}"
    return line


def _checkpoint_lines(run_dir: Path) -> list[str]:
    checkpoints = scan(run_dir / "checkpoints")
    lines = ["  checkpoints:" if checkpoints else "  checkpoints: none yet"]
    now = time.time()
    for path, step, problem in checkpoints:
        if problem is not None:
            lines.append(f"    {path.name}  INVALID: {problem} (resume skips it)")
            continue
        manifest = read_manifest(path)
        loss, created = manifest.get("loss"), manifest.get("created")
        loss_text = f"loss {loss:.4f}" if isinstance(loss, float) else "loss -"
        age = f"age {format_duration(now - created, style='age')}" if isinstance(created, (int, float)) else "age -"
        lines.append(f"    {path.name}  step {step}  {loss_text}  {age}  valid")
    return lines


def status_report(run_dir: Path) -> tuple[str, str | None]:
    """Progress, each checkpoint (step, loss, age, valid or why not), time limit, and how to continue; and what
    is wrong with final/ (None when it verifies, "absent" when there is none)."""
    recipe = stored_recipe(run_dir)
    steps = {r["step"]: r for r in read_metrics(run_dir / METRICS) if "loss" in r}
    last = max(steps) if steps else 0
    manifests = [read_manifest(path) for path, _, problem in scan(run_dir / "checkpoints", check_files=False)
                 if problem is None]
    # An epoch-based run's step count is known once training has started: the checkpoints record it.
    planned = recipe.training.max_steps or next((m.get("total_steps") for m in manifests if m.get("total_steps")), None)
    total = f"/{planned}" if planned else ""
    elapsed = (steps[last].get("elapsed_s") or 0.0) if steps else 0.0
    lines = [f"run {run_dir}", f"  model {recipe.model.name_or_path}; data {recipe.data.describe()}",
             f"  progress: step {last}{total} logged; {elapsed / 60:.1f} min of training"]
    sparkline = loss_sparkline([steps[step] for step in sorted(steps)])
    if sparkline:
        lines.append(f"  {sparkline}")
    nonfinite = sum(1 for record in steps.values() if record.get("nonfinite"))
    if nonfinite:
        lines.append(f"  warning: {nonfinite} of {len(steps)} logged steps were skipped for a non-finite loss or "
                     f"gradient norm (no update): lower training.learning_rate (now {recipe.training.learning_rate:g})")
    lines += _checkpoint_lines(run_dir)
    lines.append(_session_line(run_dir, recipe.checkpoint.time_limit))
    final = final_problem(run_dir)
    if final is None:
        what = "model" if read_manifest(run_dir / "final").get("weights") == "model" else "adapter"
        lines.append(f"  finished: the {what} is in final/ (verified against its manifest)")
    elif final != "absent":
        lines.append(f"  final/ INVALID: {final}; continue with: gpupoor resume {run_dir} (writes it again from "
                     "the last checkpoint)")
    else:
        lines.append(f"  continue with: gpupoor resume {run_dir}")
    return "\n".join(lines), final

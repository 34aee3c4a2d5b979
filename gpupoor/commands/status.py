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
    """`loss █▆▅▄▃▂▁ mean 6.002 -> 5.898 (steps 1-1200, 30 per mark)`: the step records' losses averaged into at
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
    if per > 1:  # the ends are the first and last marks' means, and say so: no logged step has those losses
        span += f", {per:.0f} per mark" if per == int(per) else f", ~{per:.1f} per mark"
        return f"loss {marks} mean {means[0]:.4g} -> {means[-1]:.4g} ({span})"
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
    records = read_metrics(run_dir / METRICS)
    steps = {r["step"]: r for r in records if "loss" in r}
    last = max(steps) if steps else 0
    running = RunLock.held(run_dir)
    planned = _planned_steps(run_dir, recipe, records)
    total = f"/{planned}" if planned else ""
    elapsed = (steps[last].get("elapsed_s") or 0.0) if steps else 0.0
    lines = [f"run {run_dir}", f"  model {recipe.model.name_or_path}; data {recipe.data.describe()}",
             f"  progress: step {last}{total} logged; {elapsed / 60:.1f} min of training"
             + (_eta(steps, last, planned) if running else "")]
    sparkline = loss_sparkline([steps[step] for step in sorted(steps)])
    if sparkline:
        lines.append(f"  {sparkline}")
    if steps and "reward" in steps[last]:
        lines.append(_reward_line([steps[step] for step in sorted(steps)]))
    nonfinite = sum(1 for record in steps.values() if record.get("nonfinite"))
    if nonfinite:
        lines.append(f"  warning: {nonfinite} of {len(steps)} logged steps were skipped for a non-finite loss or "
                     f"gradient norm (no update): lower training.learning_rate (now {recipe.training.learning_rate:g})")
    lines += _checkpoint_lines(run_dir)
    lines += _model_change_lines(run_dir, recipe)
    lines.append(_session_line(run_dir, recipe.checkpoint.time_limit))
    final = final_problem(run_dir)
    if final is None:
        what = "model" if read_manifest(run_dir / "final").get("weights") == "model" else "adapter"
        lines.append(f"  finished: the {what} is in final/ (verified against its manifest)")
    elif final != "absent":
        lines.append(f"  final/ INVALID: {final}; continue with: gpupoor resume {run_dir} (writes it again from "
                     "the last checkpoint)")
    elif not running:  # a live run continues by itself: resuming it now would be refused (its lock is held)
        lines.append(f"  continue with: gpupoor resume {run_dir}")
    return "\n".join(lines), final


def _reward_line(records: list[dict]) -> str:
    """GRPO: the sampled answers' mean reward over the last steps against the first ones, and the rest of it."""
    window = max(1, min(10, len(records) // 4))

    def mean(key: str, part: list[dict]) -> float:
        return sum(r.get(key, 0.0) for r in part) / len(part)

    recent = records[-window:]
    return (f"  reward {mean('reward', recent):.3f} over the last {window} steps (the first {window}: "
            f"{mean('reward', records[:window]):.3f}); spread in a group {mean('reward_std', recent):.3f}, KL "
            f"{mean('kl', recent):.4f}, clipped {mean('clip_fraction', recent):.1%}, answers "
            f"{mean('answer_tokens', recent):.1f} tokens")


def _model_change_lines(run_dir: Path, recipe) -> list[str]:
    """A warning for each model the run trained with (as its newest manifest records them) whose files changed at
    the same path since, or that cannot be read: the verbs that load it refuse it."""
    from gpupoor.model.identity import current_identity, identity_change

    newest = [run_dir / "final"] if (run_dir / "final").is_dir() else []
    newest += [path for path, _, problem in scan(run_dir / "checkpoints", check_files=False) if problem is None]
    manifest = read_manifest(newest[0]) if newest else {}
    adapter = manifest.get("weights") != "model"
    roles = {"model.name_or_path": ("the base model", recipe.model.revision,
                                    "resume, merge-lora, export, generate and chat refuse it" if adapter else
                                    "resume refuses it"),
             "distill.teacher": ("the distillation teacher", recipe.distill.revision if recipe.distill else None,
                                 "resume refuses it")}
    lines = []
    for key, record in (manifest.get("models") or {}).items():
        if not isinstance(record, dict) or key not in roles:
            continue
        what, revision, refused = roles[key]
        try:
            change = identity_change(record, current_identity(record, revision))
        except OSError as exc:
            change = f"cannot be read: {exc}"
        if change is not None:
            lines.append(f"  warning: {what} changed since the run trained on it ({change}): {refused} unless "
                         "--force")
    return lines


def _planned_steps(run_dir: Path, recipe, records: list[dict]) -> int | None:
    """The run's step count: the recipe's max_steps, else (an epoch-based run) what its latest start record or a
    checkpoint says, known from the first step on."""
    if recipe.training.max_steps:
        return recipe.training.max_steps
    started = [r["total_steps"] for r in records if r.get("event") == "start" and r.get("total_steps")]
    if started:
        return started[-1]
    manifests = [read_manifest(path) for path, _, problem in scan(run_dir / "checkpoints", check_files=False)
                 if problem is None]
    return next((m.get("total_steps") for m in manifests if m.get("total_steps")), None)


def _eta(steps: dict[int, dict], last: int, planned: int | None) -> str:
    """`; ETA 12m at 1.6 s a step`: the steps left at the median pace of the last 20 logged steps."""
    paces = sorted(steps[step]["step_s"] for step in sorted(steps)[-20:]
                   if isinstance(steps[step].get("step_s"), (int, float)))
    if not planned or not paces or last >= planned:
        return ""
    pace = paces[len(paces) // 2]
    return f"; ETA {format_duration((planned - last) * pace, style='age')} at {pace:.3g} s a step"

"""What a resume may change, and `gpupoor status`. Imports no torch.

A recipe change on resume is either safe (how long to train, when to save, what to print, where to evaluate)
or changes the trajectory (everything else): those are refused with a field-by-field diff unless --force.
The list of safe keys is explicit; any key not on it is treated as changing the trajectory.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from gpupoor.recipe import Recipe

SAFE_KEYS = (
    "training.max_steps", "training.epochs", "training.eval_every_steps", "training.device",
    "training.cpu_threads", "training.max_consecutive_skips", "memory.gradient_checkpointing",
    "data.eval_path", "data.eval_split", "data.cache_dir", "checkpoint.", "logging.", "output_dir",
)


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        flat: dict[str, object] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def is_safe(key: str) -> bool:
    return any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in SAFE_KEYS)


def diff_recipes(old: Recipe, new: Recipe) -> tuple[list[tuple[str, object, object]], list[tuple[str, object, object]]]:
    """(trajectory changes, safe changes), each as (dotted key, old value, new value)."""
    before, after = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    changes = [(key, before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
               if before.get(key) != after.get(key)]
    return [c for c in changes if not is_safe(c[0])], [c for c in changes if is_safe(c[0])]


def format_changes(changes: list[tuple[str, object, object]]) -> str:
    return "\n".join(f"    {key}: {json.dumps(old)} -> {json.dumps(new)}" for key, old, new in changes)


def trajectory_hash(recipe: Recipe) -> str:
    """Hash of every field that shapes the training trajectory (recorded in each checkpoint's manifest)."""
    fields = {k: v for k, v in _flatten(recipe.model_dump(mode="json")).items() if not is_safe(k)}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _session_line(run_dir: Path, time_limit: str | None) -> str:
    from gpupoor.run import SESSION, RunLock

    budget = f"time limit {time_limit} per invocation" if time_limit else "no time limit"
    if not RunLock.held(run_dir):
        return f"  not running; {budget}"
    try:
        session = json.loads((run_dir / SESSION).read_text())
        line = f"  running: pid {int(session['pid'])}"
        if session.get("time_limit_s"):
            left = float(session["started"]) + float(session["time_limit_s"]) - time.time()
            line += f", time limit left {_age(max(0.0, left))}"
        return line
    except (OSError, ValueError, KeyError, TypeError):
        return "  running (starting up)"


def status_report(run_dir: Path) -> str:
    """Progress, each checkpoint (step, loss, age, valid or why not), time limit, and how to continue."""
    from gpupoor.checkpoint import final_problem, scan
    from gpupoor.recipe import load_recipe

    recipe = load_recipe(run_dir / "recipe.yaml").recipe
    from gpupoor.train.report import read_metrics

    steps = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}
    last = max(steps) if steps else 0
    checkpoints = scan(run_dir / "checkpoints", check_files=False)
    manifests = [json.loads((path / "manifest.json").read_text()) for path, _, problem in checkpoints if problem is None]
    # An epoch-based run's step count is known once training has started: the checkpoints record it.
    planned = recipe.training.max_steps or next((m.get("total_steps") for m in manifests if m.get("total_steps")), None)
    lines = [f"run {run_dir}", f"  model {recipe.model.name_or_path}; data {recipe.data.path}"]
    total = f"/{planned}" if planned else ""
    elapsed = steps[last]["elapsed_s"] if steps else 0.0
    lines.append(f"  progress: step {last}{total} logged; {elapsed / 60:.1f} min of training")
    final = final_problem(run_dir)
    checkpoints = scan(run_dir / "checkpoints")
    lines.append("  checkpoints:" if checkpoints else "  checkpoints: none yet")
    now = time.time()
    for path, step, problem in checkpoints:
        if problem is None:
            manifest = json.loads((path / "manifest.json").read_text())
            loss = manifest.get("loss")
            loss_text = f"loss {loss:.4f}" if isinstance(loss, float) else "loss -"
            created = manifest.get("created")
            age = f"age {_age(now - created)}" if isinstance(created, (int, float)) else "age -"
            lines.append(f"    {path.name}  step {step}  {loss_text}  {age}  valid")
        else:
            lines.append(f"    {path.name}  INVALID: {problem} (resume skips it)")
    lines.append(_session_line(run_dir, recipe.checkpoint.time_limit))
    if final is None:
        lines.append("  finished: the adapter is in final/ (verified against its manifest)")
    elif final != "absent":
        lines.append(f"  final/ INVALID: {final}; continue with: gpupoor resume {run_dir} (writes it again from "
                     "the last checkpoint)")
    else:
        lines.append(f"  continue with: gpupoor resume {run_dir}")
    return "\n".join(lines)

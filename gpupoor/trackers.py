"""Trackers: every metrics record also goes to TensorBoard, Weights & Biases or MLflow (`logging.report_to`),
through accelerate's tracker classes, with the recipe as the run's config.

metrics.jsonl stays the record of truth. A tracker that fails (no network, a full disk, a missing login) warns
once and is dropped; training goes on. All three work offline: TensorBoard event files in RUN_DIR/tensorboard,
W&B offline runs in RUN_DIR/wandb, an MLflow file store in RUN_DIR/mlruns.

A resumed run continues the same tracker run (W&B and MLflow run ids are kept in RUN_DIR/trackers.json) and
logs no step twice: the records between the checkpoint and the interruption were logged already (metrics.jsonl
had them before the resume trimmed it), and exact resume trains them again to the same values, so the trackers
skip them; a record of a step that was not logged (the checkpoint whose save was interrupted) still goes out.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from gpupoor.files import write_text_atomic

# name -> (module that must import, the pip extra that installs it)
TRACKERS = {"tensorboard": ("tensorboard", "gpupoor[tensorboard]"), "wandb": ("wandb", "gpupoor[wandb]"),
            "mlflow": ("mlflow", "gpupoor[mlflow]")}
STATE_FILE = "trackers.json"
# metrics record key -> tracker key: namespaced as the trackers' dashboards group them.
KEYS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
        "tokens": "train/tokens", "target_tokens": "train/target_tokens", "epoch": "train/epoch",
        "step_s": "train/step_s", "peak_mem_mb": "memory/peak_mb", "predicted_peak_mb": "memory/predicted_peak_mb",
        "optimizer_state_mb": "memory/optimizer_state_mb", "eval_loss": "eval/loss",
        "eval_accuracy": "eval/accuracy", "save_s": "checkpoint/save_s"}
# Preference tuning's step and eval metrics (gpupoor.preference.METRICS, which imports torch): train/rewards/chosen,
# eval/rewards/chosen...
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                      "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen")
KEYS.update({name: f"train/{name}" for name in PREFERENCE_METRICS})
KEYS.update({f"eval_{name}": f"eval/{name}" for name in PREFERENCE_METRICS})


def missing_trackers(report_to: list[str]) -> list[str]:
    """The pip extras of the trackers named that do not import here."""
    return [TRACKERS[name][1] for name in report_to if importlib.util.find_spec(TRACKERS[name][0]) is None]


def tracker_values(record: dict) -> dict[str, float]:
    """The numbers of a metrics record under the trackers' names; a skipped step logs train/skipped = 1."""
    values = {KEYS[key]: float(value) for key, value in record.items()
              if key in KEYS and isinstance(value, (int, float)) and not isinstance(value, bool)}
    if "loss" in record:
        values["train/skipped"] = float(bool(record.get("skipped")))
    for key, prefix in (("eval_loss_by_source", "eval/loss/"), ("eval_accuracy_by_source", "eval/accuracy/"),
                        ("examples_by_source", "data/examples/")):
        # A source's name is the user's: keep what every tracker accepts in a key (MLflow is the strictest).
        values.update({prefix + re.sub(r"[^\w\-. /]", "_", name): float(value)
                       for name, value in record.get(key, {}).items()})
    return values


def record_kind(record: dict) -> str:
    return "train" if "loss" in record else "eval" if "eval_loss" in record else \
        "checkpoint" if "checkpoint" in record else f"event:{record.get('event')}"


def already_logged(records: list[dict]) -> set[tuple[int, str]]:
    """(step, kind) of every record an earlier session wrote, hence logged."""
    return {(record.get("step", 0), record_kind(record)) for record in records}


def flat_config(recipe_dump: dict, prefix: str = "") -> dict[str, object]:
    """The recipe as flat `section.key` -> str/int/float/bool, what every tracker's config accepts."""
    flat: dict[str, object] = {}
    for key, value in recipe_dump.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (str, int, float, bool)) else json.dumps(value)
    return flat


class Trackers:
    """The trackers of one session of a run, on the main process. `logged`: what earlier sessions logged
    (already_logged); those records are not sent again."""

    def __init__(self, run_dir: Path, logging, recipe_dump: dict, logged: set[tuple[int, str]], warn):
        self.run_dir, self.logging, self.logged, self.warn = run_dir, logging, logged, warn
        self.active: list = []
        for name in logging.report_to:
            try:
                self.active.append(self._start(name, recipe_dump))
            except Exception as exc:  # an import, a login, the network: never a reason to stop training
                self._warn(name, exc)
        self._save_ids()

    def _start(self, name: str, recipe_dump: dict):
        from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

        ids = self._saved_ids()
        project, run_name = self.logging.project, self.logging.run_name or self.run_dir.name
        if name == "tensorboard":
            tracker = TensorBoardTracker("", self.run_dir / "tensorboard")
        elif name == "wandb":
            options = {"name": run_name, "dir": str(self.run_dir)}
            if self.logging.offline:
                options["mode"] = "offline"
            if ids.get("wandb"):
                options.update(id=ids["wandb"], resume="allow")
            tracker = WandBTracker(project, **options)
        else:
            self._mlflow_store()
            tracker = MLflowTracker(project, run_id=ids.get("mlflow"), run_name=run_name)
        tracker.start()
        if not ids.get(name):  # a new tracker run gets the recipe; a resumed one has it
            tracker.store_init_configuration(flat_config(recipe_dump))
        return tracker

    def _mlflow_store(self) -> None:
        """MLflow's own MLFLOW_TRACKING_URI when set (and not offline), else a file store in the run dir."""
        import os

        import mlflow

        if self.logging.offline or not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps its file store but asks for this opt-in; a database backend would need a server's
            # dependencies that mlflow-skinny leaves out.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((self.run_dir / "mlruns").resolve().as_uri())

    def _saved_ids(self) -> dict:
        try:
            ids = json.loads((self.run_dir / STATE_FILE).read_text())
            return ids if isinstance(ids, dict) else {}
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: the trackers start new runs

    def _save_ids(self) -> None:
        ids = self._saved_ids()
        for tracker in self.active:
            if tracker.name == "wandb":
                ids["wandb"] = tracker.run.id
            elif tracker.name == "mlflow":
                ids["mlflow"] = tracker.active_run.info.run_id
        if ids:
            write_text_atomic(self.run_dir / STATE_FILE, json.dumps(ids, indent=1))

    def log(self, record: dict) -> None:
        step = record.get("step", 0)
        values = tracker_values(record)
        if not values or (step, record_kind(record)) in self.logged:
            return
        for tracker in list(self.active):
            try:
                tracker.log(values, step=step)
            except Exception as exc:
                self.active.remove(tracker)
                self._warn(tracker.name, exc)

    def _warn(self, name: str, exc: Exception) -> None:
        self.warn(f"warning: tracker {name} failed ({type(exc).__name__}: {exc}); training goes on without it "
                  "(metrics.jsonl has every record)")

    def close(self) -> None:
        for tracker in self.active:
            try:
                tracker.finish()
            except Exception as exc:
                self._warn(tracker.name, exc)
        self.active = []

"""Trackers: every metrics record also goes to TensorBoard, Weights & Biases or MLflow (`logging.report_to`),
through accelerate's tracker classes, with the recipe as the run's config.

metrics.jsonl stays the record of truth. A tracker that fails (no network, a full disk, a missing login) warns
once and is dropped; training goes on. All three work offline: TensorBoard event files in RUN_DIR/tensorboard,
W&B offline runs in RUN_DIR/wandb, an MLflow file store in RUN_DIR/mlruns.

A resumed run continues the same tracker run (W&B and MLflow run ids are kept in RUN_DIR/trackers.json) and
ends with every step logged once: each tracker is sent what metrics.jsonl has that it lacks, first the records up
to the checkpoint, then each record of the new session. What a tracker holds: TensorBoard and MLflow write each
record as it is logged, so every record an earlier session wrote (metrics.jsonl had it before the resume trimmed
it; exact resume trains those steps again to the same values); a W&B offline run holds what its transaction logs
in RUN_DIR/wandb hold, read back (a SIGKILL loses what W&B had not yet written, often the whole session); a new
tracker run holds nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import zlib
from pathlib import Path

from gpupoor.storage.files import write_text_atomic

# name -> (module that must import, the package that installs it: also gpupoor's extra of the tracker's name)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}
STATE_FILE = "trackers.json"
# An MLflow server that does not answer would hold training for MLflow's ~4 minutes of retries per request (7,
# backing off up to 120 s, 120 s timeout each): give up within ~20 s instead, then warn once and drop the tracker.
# What the user set stands.
MLFLOW_PATIENCE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                   "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
# metrics record key -> tracker key: namespaced as the trackers' dashboards group them.
KEYS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
        "tokens": "train/tokens", "target_tokens": "train/target_tokens", "epoch": "train/epoch",
        "step_s": "train/step_s", "peak_mem_mb": "memory/peak_mb", "predicted_peak_mb": "memory/predicted_peak_mb",
        "optimizer_state_mb": "memory/optimizer_state_mb", "eval_loss": "eval/loss",
        "eval_accuracy": "eval/accuracy", "save_s": "checkpoint/save_s"}
# Preference tuning's step and eval metrics (gpupoor.objectives.preference.METRICS, which imports torch): train/rewards/chosen,
# eval/rewards/chosen...
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                      "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen")
KEYS.update({name: f"train/{name}" for name in PREFERENCE_METRICS})
KEYS.update({f"eval_{name}": f"eval/{name}" for name in PREFERENCE_METRICS})
# GRPO's (gpupoor.objectives.grpo.objective.STEP_METRICS and EVAL_METRICS); each reward's own mean, reward_NAME,
# goes to train/reward/NAME (eval/reward/NAME) by its prefix.
GRPO_METRICS = ("reward", "reward_std", "kl", "clip_fraction", "answer_tokens")
KEYS.update({name: f"train/{name}" for name in GRPO_METRICS})
KEYS.update({f"eval_{name}": f"eval/{name}" for name in ("reward", "answer_tokens")})


def missing_trackers(report_to: list[str]) -> list[str]:
    """The trackers named whose package does not import here."""
    return [name for name in report_to if importlib.util.find_spec(TRACKERS[name][0]) is None]


def tracker_values(record: dict) -> dict[str, float]:
    """The numbers of a metrics record under the trackers' names; a skipped step logs train/skipped = 1."""
    numbers = {key: value for key, value in record.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    values = {KEYS[key]: float(value) for key, value in numbers.items() if key in KEYS}
    values.update({("eval/reward/" if key.startswith("eval_") else "train/reward/") + key.split("reward_", 1)[1]:
                   float(value) for key, value in numbers.items()
                   if key not in KEYS and key.removeprefix("eval_").startswith("reward_")})
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


# A W&B transaction log (run-ID.wandb): a 7-byte header, then records in 32 KiB blocks, each record a 7-byte
# header (CRC-32 seeded with the type byte, length, type: whole, first, middle or last part) and a protobuf Record.
WANDB_MAGIC, WANDB_BLOCK, WANDB_RECORD_HEADER = b":W&B", 32768, 7
WANDB_FULL, WANDB_FIRST, WANDB_MIDDLE, WANDB_LAST = 1, 2, 3, 4
# The key that every row of a record kind has (tracker_values): a W&B row holding it holds that record.
KIND_KEYS = {"train": "train/skipped", "eval": "eval/loss", "checkpoint": "checkpoint/save_s"}


def wandb_log_records(path: Path):
    """The raw records of one W&B transaction log, up to the first that is cut short or damaged (a kill)."""
    data = path.read_bytes()
    if len(data) < WANDB_RECORD_HEADER:
        return
    if not data.startswith(WANDB_MAGIC):
        raise ValueError(f"{path} is not a W&B transaction log")
    position, pending = WANDB_RECORD_HEADER, b""
    while position + WANDB_RECORD_HEADER <= len(data):
        left_in_block = WANDB_BLOCK - position % WANDB_BLOCK
        if left_in_block < WANDB_RECORD_HEADER:  # the end of a block is padding
            position += left_in_block
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, position)
        body = data[position + WANDB_RECORD_HEADER:position + WANDB_RECORD_HEADER + length]
        if len(body) < length or zlib.crc32(body, zlib.crc32(bytes([kind]))) != checksum:
            return
        position += WANDB_RECORD_HEADER + length
        if kind in (WANDB_FULL, WANDB_FIRST):
            pending = body
        elif kind in (WANDB_MIDDLE, WANDB_LAST):
            pending += body
        if kind in (WANDB_FULL, WANDB_LAST):
            yield pending


def wandb_offline_history(run_dir: Path, run_id: str) -> list[tuple[int, dict]]:
    """(step, {key: value}) of every history row that the W&B offline runs of `run_id` in RUN_DIR/wandb hold,
    session after session (a resumed offline run is a new run directory with the same id, synced after the
    earlier ones)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in _wandb_logs(run_dir, run_id):
        for raw in wandb_log_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                rows.append((record.history.step.num, {item.key or "/".join(item.nested_key): _wandb_value(item)
                                                       for item in record.history.item}))
    return rows


def _wandb_logs(run_dir: Path, run_id: str) -> list[Path]:
    """The transaction logs of `run_id`'s offline sessions, oldest first: RUN_DIR/wandb/offline-run-TIME-ID, and
    offline-run-TIME-ID-N when a session started within the same second as an earlier one."""
    pattern = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    sessions = []
    for folder in (run_dir / "wandb").glob(f"offline-run-*-{run_id}*"):
        match = pattern.fullmatch(folder.name)
        if match and (folder / f"run-{run_id}.wandb").is_file():
            sessions.append(((match.group(1), int(match.group(2) or 0)), folder / f"run-{run_id}.wandb"))
    return [path for _, path in sorted(sessions)]


def _wandb_value(item):
    kind = item.WhichOneof("value")
    return json.loads(item.value_json or "null") if kind in (None, "value_json") else getattr(item, kind)


def wandb_held(run_dir: Path, run_id: str) -> set[tuple[int, str]]:
    """(step, kind) of the records a W&B offline run holds, as already_logged gives them for metrics.jsonl."""
    return {(step, kind) for step, values in wandb_offline_history(run_dir, run_id)
            for kind, key in KIND_KEYS.items() if key in values}


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
    """The trackers of one session of a run, on the main process. `logged`: what earlier sessions wrote to
    metrics.jsonl (already_logged). Each tracker is sent the records it does not hold (`held`, by name): at the
    start, those of metrics.jsonl (the records up to the checkpoint a resume continues from); then the new ones."""

    def __init__(self, run_dir: Path, logging, recipe_dump: dict, logged: set[tuple[int, str]], warn):
        from gpupoor.train.metrics import read_metrics

        self.run_dir, self.logging, self.logged, self.warn = run_dir, logging, logged, warn
        self.active: list = []
        self.held: dict[str, set[tuple[int, str]]] = {}
        for name in logging.report_to:
            try:
                self.held[name] = self._holds(name)
                self.active.append(self._start(name, recipe_dump))
            except Exception as exc:  # an import, a login, the network: never a reason to stop training
                self._warn(name, exc)
        self._save_ids()
        for record in read_metrics(run_dir / "metrics.jsonl"):
            self.log(record)

    def _holds(self, name: str) -> set[tuple[int, str]]:
        """(step, kind) of the records the tracker's run holds, before this session starts it."""
        ids = self._saved_ids()
        if name == "tensorboard":
            return self.logged if (self.run_dir / "tensorboard").is_dir() else set()
        if not ids.get(name):
            return set()  # a new tracker run
        offline = self.logging.offline or os.environ.get("WANDB_MODE") in ("offline", "dryrun")
        if name == "wandb" and offline:
            try:
                return wandb_held(self.run_dir, ids["wandb"])
            except Exception as exc:  # a format this reader does not know: assume it has what metrics.jsonl had
                self.warn(f"warning: cannot read what the W&B offline run {ids['wandb']} holds ({exc}); records "
                          "an earlier session wrote are not sent again")
        return self.logged

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
        import mlflow

        if self.logging.offline or not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps its file store but asks for this opt-in; a database backend would need a server's
            # dependencies that mlflow-skinny leaves out.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((self.run_dir / "mlruns").resolve().as_uri())
        else:
            for key, value in MLFLOW_PATIENCE.items():
                os.environ.setdefault(key, value)
            # Said again: an earlier run in this process (the demo, tests) may have set the run dir's store.
            mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])

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
        if not values:
            return
        for tracker in list(self.active):
            if (step, record_kind(record)) in self.held[tracker.name]:
                continue
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

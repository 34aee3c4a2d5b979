"""What a run tells the world: metrics.jsonl (every step) and a progress bar or plain log lines."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from gpupoor.storage.files import write_text_atomic
from gpupoor.units import format_duration


class MetricsWriter:
    """Appends one JSON object per line and flushes, so a killed run keeps every record it wrote."""

    def __init__(self, path: Path):
        self.handle = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        # A non-finite loss is written as null: NaN is not JSON, and other tools would reject the line.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.handle.write(json.dumps(clean) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class NullWriter:
    """What processes other than the main one write: nothing (one process keeps the records)."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


# Keys whose values the readers (status, report, the trackers) compute with: a number, or null for a non-finite one.
NUMBERS = ("loss", "lr", "grad_norm", "tokens", "target_tokens", "tokens_per_s", "peak_mem_mb", "step_s", "elapsed_s",
           "epoch", "eval_loss", "eval_accuracy", "save_s", "predicted_peak_mb", "optimizer_state_mb", "best_eval_loss",
           "predicted_step_s")
BY_SOURCE = ("examples_by_source", "eval_loss_by_source", "eval_accuracy_by_source")  # {source name: number}


def _record_problem(line: bytes) -> tuple[dict | None, str | None]:
    """(the record, None), or (None, why the line is not one)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError:
        return None, "not JSON"
    if not isinstance(record, dict):
        what = "null" if record is None else "a list" if isinstance(record, list) else \
            "a string" if isinstance(record, str) else "a bare value"
        return None, f"{what}, not an object"
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None, "no step number"
    wrong = next((key for key in NUMBERS if key in record and (isinstance(record[key], bool) or not (
        record[key] is None or isinstance(record[key], (int, float))))), None)
    if wrong is not None:
        return None, f"{wrong} is not a number"
    wrong = next((key for key in BY_SOURCE if key in record and not _numbers_by_name(record[key])), None)
    if wrong is not None:
        return None, f"{wrong} is not numbers by source name"
    return record, None


def _numbers_by_name(value) -> bool:
    return isinstance(value, dict) and all(
        isinstance(number, (int, float)) and not isinstance(number, bool) for number in value.values())


def parse_metrics(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """The records of a metrics.jsonl, and (line number, why) of each line that is not one. A last line cut short
    by a kill (no newline at its end) is left out without counting: a killed run writes one."""
    records, bad = [], []
    data = path.read_bytes() if path.is_file() else b""
    lines = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record, problem = _record_problem(line)
        if record is not None:
            records.append(record)
        elif number < len(lines):  # the last piece has no newline after it: cut short by a kill, whatever it reads as
            bad.append((number, problem))
    return records, bad


def bad_lines_message(path: Path, bad: list[tuple[int, str]]) -> str:
    first = f"line {bad[0][0]}: {bad[0][1]}"
    what = f"1 line that is not a metrics record ({first})" if len(bad) == 1 else \
        f"{len(bad)} lines that are not metrics records (first {first})"
    return f"warning: {path}: skipped {what}; each line is one JSON object with a step"


def read_metrics(path: Path, warn=None) -> list[dict]:
    """Every record of a metrics.jsonl. Lines that are not records (edited by hand, a disk error) are skipped
    and counted in one warning to `warn` (default: standard error); they never stop a reader."""
    records, bad = parse_metrics(path)
    if bad:
        (warn or (lambda text: print(text, file=sys.stderr, flush=True)))(bad_lines_message(path, bad))
    return records


def last_metrics(run_dir: Path) -> dict:
    """A run's last training step and loss, and its last eval loss: what a merged model's card reports."""
    last: dict = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        if "loss" in record:
            last.update(step=record["step"], loss=record["loss"])
        if "eval_loss" in record:
            last["eval_loss"] = record["eval_loss"]
    return last


def truncate_metrics(path: Path, records: list[dict], step: int, eval_redone: bool) -> None:
    """Rewrite `path` with the `records` (read_metrics) of steps up to a checkpoint's `step`: those after it
    will be trained (and logged) again. With `eval_redone`, so is an eval of that step itself: a process may have
    died between the checkpoint and that eval, and the resumed run evaluates the step again (the same weights,
    so the same value)."""
    if path.is_file():
        # With the eval redone, what judged it (a best checkpoint, an early stop) is judged again too.
        redone = ("best", "early_stop")
        kept = [record for record in records if record["step"] < step
                or (record["step"] == step
                    and not (eval_redone and ("eval_loss" in record or record.get("event") in redone)))]
        write_text_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))


def format_step(record: dict, total: int, eta_s: float) -> str:
    return (f"step {record['step']}/{total}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"{record['tokens_per_s']:.0f} tok/s  peak {record['peak_mem_mb']:.0f} MiB  eta {format_duration(eta_s)}")


class Progress:
    """A rich progress bar on a terminal; plain lines every `every` steps otherwise (logs, CI, notebooks)."""

    def __init__(self, total: int, start_step: int, mode: str = "auto", every: int = 1):
        self.total, self.every = total, every
        self.mode = ("bar" if sys.stdout.isatty() else "plain") if mode == "auto" else mode
        self.started, self.start_step = time.perf_counter(), start_step
        self.bar = None
        if self.mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeRemainingColumn

            self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, completed=start_step, info="")
            self.bar.start()

    def step(self, record: dict) -> None:
        done = record["step"] - self.start_step
        eta = (time.perf_counter() - self.started) / max(done, 1) * (self.total - record["step"])
        if self.bar is not None:
            info = (f"loss {record['loss']:.4f} lr {record['lr']:.1e} {record['tokens_per_s']:.0f} tok/s "
                    f"{record['peak_mem_mb']:.0f} MiB")
            self.bar.update(self.task, completed=record["step"], info=info)
        elif self.mode == "plain" and (record["step"] % self.every == 0 or record["step"] == self.total):
            print(format_step(record, self.total, eta), flush=True)

    def message(self, text: str, always: bool = False) -> None:
        """Print beside the progress (through the bar's console when there is one); `always` prints even
        with progress off, for what belongs to the startup summary."""
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.mode != "none" or always:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()

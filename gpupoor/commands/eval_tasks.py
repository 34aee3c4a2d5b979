"""`gpupoor eval --tasks`: lm-evaluation-harness's tasks on the base and on the tuned model, when the harness is
installed (the `tasks` extra). The model is gpupoor's own load of the run (`load_generator`: the base quantized as
trained, the adapter applied, the precision chosen here) handed to the harness as a model object, so nothing is
loaded twice and the base column is the same weights with the adapter switched off.

A task is a name the harness knows, or a task YAML file of your own (its folder is added to the harness's search
path). The harness's own tasks read their datasets from the Hugging Face hub, which needs a network; a task YAML
whose `dataset_path: json` names local `data_files` runs offline."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpupoor.errors import UserError

INSTALL = "pip install 'gpupoor[tasks]' (lm-evaluation-harness, lm_eval)"
OFFLINE_HINT = ("the harness's own tasks download their datasets from the Hugging Face hub, which needs a network "
                "(unset HF_HUB_OFFLINE); offline, write a task YAML with dataset_path: json and local data_files "
                "(docs/cli.md, gpupoor eval)")


@dataclass
class PreparedTasks:
    """--tasks, checked before any model loads: the harness's names to run, the task YAML files of the user's
    (each read by the harness already), and the harness's task index (which takes a while to build: built once)."""

    names: list[str]
    files: list[Path]
    manager: object  # lm_eval.tasks.TaskManager


def task_names(tasks: list[str]) -> tuple[list[str], list[str], list[tuple[Path, str]]]:
    """(the names to run, the folders of task YAML files to search, each such file with its task's name): a `.yaml`
    argument is a file of yours."""
    names, folders, files = [], [], []
    for task in tasks:
        path = Path(task).expanduser()
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise UserError(f"--tasks {task}: no such task file", hint="give a task name the harness knows, or "
                                "the path of a task YAML")
            import yaml

            try:
                config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            except (yaml.YAMLError, UnicodeDecodeError) as exc:
                raise UserError(f"--tasks {task}: not readable YAML ({exc})".replace("\n", " "),
                                hint="fix the task YAML (docs/cli.md, gpupoor eval, shows one)") from None
            if not isinstance(config, dict) or not config.get("task"):
                raise UserError(f"--tasks {task}: a task YAML names its task (`task: NAME`)")
            names.append(str(config["task"]))
            folders.append(str(path.resolve().parent))
            files.append((Path(task), str(config["task"])))
        else:
            names.append(task)
    return names, sorted(set(folders)), files


def prepare_tasks(tasks: list[str]) -> PreparedTasks:
    """The harness imported, every task known to it, and each task YAML of the user's read by it (its dataset
    built, as the evaluation will), so that a task the harness cannot read is exit 2 naming the file and what the
    harness said, before the model loads. The harness's own tasks are read when they run (their datasets come from
    the hub, and a big group's take long to load)."""
    try:
        import lm_eval  # noqa: F401
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("--tasks needs lm-evaluation-harness, which is not installed", hint=INSTALL) from None
    names, folders, files = task_names(tasks)
    manager = TaskManager(include_path=folders or None)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise UserError(f"--tasks {unknown[0]}: not a task lm-evaluation-harness knows",
                        hint="see `lm_eval --tasks list`, or give the path of a task YAML of your own")
    for path, name in files:
        try:
            load_task(manager, name)
        except Exception as exc:  # noqa: BLE001 - whatever the harness raises on a user's file is the file's fault
            raise UserError(f"--tasks {path}: lm-evaluation-harness cannot read this task ({said(exc)})",
                            hint="fix the task YAML or the data it names (dataset_path, dataset_kwargs, "
                            "test_split, doc_to_text, doc_to_target), then run again") from None
    return PreparedTasks(names, [path for path, _ in files], manager)


def load_task(manager, name: str) -> None:
    """The task built by the harness as its evaluation does (its dataset loaded): TaskManager.load in the
    harness's newer versions, get_task_dict in the older ones the `tasks` extra allows."""
    if hasattr(manager, "load"):
        manager.load([name])
    else:
        from lm_eval.tasks import get_task_dict

        get_task_dict([name], manager)


def said(exc: BaseException) -> str:
    """An exception and the ones that caused it, as one line: `datasets` wraps the parse error that says what is
    wrong (`DatasetGenerationError: An error occurred while generating the dataset; ArrowInvalid: JSON parse
    error: Invalid value. in row 1`)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen and len(parts) < 3:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}".replace("\n", " ").strip())
        exc = exc.__cause__ or exc.__context__
    return "; ".join(parts)


def run_tasks(generator, prepared: PreparedTasks, limit: int | None, say: Callable[[str], None]) -> dict:
    """{column: {task: {metric: value}}} for the base (when the model is an adapter) and the tuned model."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    names = prepared.names
    lm = HFLM(pretrained=generator.model, tokenizer=generator.tokenizer, batch_size=8,
              device=str(next(generator.model.parameters()).device))

    def evaluate(column: str) -> dict:
        say(f"{column}: running {', '.join(names)} (lm-evaluation-harness)")
        try:
            with quiet_git():
                results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=prepared.manager,
                                                  limit=limit, log_samples=False, verbosity="ERROR")
        except (ConnectionError, OSError) as exc:  # a hub dataset with no network (or an unreadable file)
            raise UserError(f"--tasks {', '.join(names)}: the task's data could not be read ({exc})",
                            hint=OFFLINE_HINT) from None
        return {task: {metric.split(",")[0]: value for metric, value in scores.items()
                       if isinstance(value, (int, float)) and not metric.startswith("alias")
                       and "stderr" not in metric}
                for task, scores in results["results"].items()}

    columns = {}
    switch = getattr(generator.model, "disable_adapter", None)
    if switch is not None:
        with switch():
            columns["base"] = evaluate("base")
    columns["tuned"] = evaluate("tuned")
    return columns


@contextlib.contextmanager
def quiet_git():
    """simple_evaluate records the current directory's git commit (lm_eval.loggers.utils.get_git_commit_hash runs
    `git describe` with the terminal as its stderr), so run outside a repository it printed git's `fatal: not a
    git repository` among eval's lines. gpupoor reads only the scores, never that hash: for the call, no lookup."""
    from lm_eval import evaluator

    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:  # a harness that no longer asks git
        yield
        return

    evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def render_tasks(columns: dict) -> str:
    """One line per task and metric, one column per model; every column as wide as its widest figure, with two
    spaces between columns, so no two figures run together (a perplexity can have ten digits)."""
    names = list(columns)
    first = columns[names[-1]]
    labels = [(task, metric, f"{task} / {metric}") for task, metrics in first.items() for metric in metrics]
    figures = {name: [_figure(columns[name].get(task, {}).get(metric)) for task, metric, _ in labels]
               for name in names}
    label_width = max([len("task / metric"), *(len(label) for _, _, label in labels)])
    widths = {name: max([len(name), *(len(figure) for figure in figures[name])]) for name in names}
    lines = [f"{'task / metric':{label_width}}" + "".join(f"  {name:>{widths[name]}}" for name in names)]
    for i, (_, _, label) in enumerate(labels):
        lines.append(f"{label:{label_width}}" + "".join(f"  {figures[name][i]:>{widths[name]}}" for name in names))
    return "\n".join(lines)


def _figure(value) -> str:
    """A score as the table shows it: four decimals, or four significant digits past a million."""
    if value is None:
        return "-"
    return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"

"""`gpupoor eval --tasks`: lm-evaluation-harness's tasks on the base and on the tuned model, when the harness is
installed (the `tasks` extra). The model is gpupoor's own load of the run (`load_generator`: the base quantized as
trained, the adapter applied, the precision chosen here) handed to the harness as a model object, so nothing is
loaded twice and the base column is the same weights with the adapter switched off.

A task is a name the harness knows, or a task YAML file of your own (its folder is added to the harness's search
path). The harness's own tasks read their datasets from the Hugging Face hub, which needs a network; a task YAML
whose `dataset_path: json` names local `data_files` runs offline."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from gpupoor.errors import UserError

INSTALL = "pip install 'gpupoor[tasks]' (lm-evaluation-harness, lm_eval)"
OFFLINE_HINT = ("the harness's own tasks download their datasets from the Hugging Face hub, which needs a network "
                "(unset HF_HUB_OFFLINE); offline, write a task YAML with dataset_path: json and local data_files "
                "(docs/cli.md, gpupoor eval)")


def task_names(tasks: list[str]) -> tuple[list[str], list[str]]:
    """(the names to run, the folders of task YAML files to search): a `.yaml` argument is a file of yours."""
    names, folders = [], []
    for task in tasks:
        path = Path(task).expanduser()
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise UserError(f"--tasks {task}: no such task file", hint="give a task name the harness knows, or "
                                "the path of a task YAML")
            import yaml

            config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            if not isinstance(config, dict) or not config.get("task"):
                raise UserError(f"--tasks {task}: a task YAML names its task (`task: NAME`)")
            names.append(str(config["task"]))
            folders.append(str(path.resolve().parent))
        else:
            names.append(task)
    return names, sorted(set(folders))


def run_tasks(generator, tasks: list[str], limit: int | None, say: Callable[[str], None]) -> dict:
    """{column: {task: {metric: value}}} for the base (when the model is an adapter) and the tuned model."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("--tasks needs lm-evaluation-harness, which is not installed", hint=INSTALL) from None
    names, folders = task_names(tasks)
    manager = TaskManager(include_path=folders or None)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise UserError(f"--tasks {unknown[0]}: not a task lm-evaluation-harness knows",
                        hint="see `lm_eval --tasks list`, or give the path of a task YAML of your own")
    lm = HFLM(pretrained=generator.model, tokenizer=generator.tokenizer, batch_size=8,
              device=str(next(generator.model.parameters()).device))

    def evaluate(column: str) -> dict:
        say(f"{column}: running {', '.join(names)} (lm-evaluation-harness)")
        try:
            results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                              log_samples=False, verbosity="ERROR")
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


def render_tasks(columns: dict) -> str:
    """One line per task and metric, one column per model."""
    names = list(columns)
    lines = [f"{'task / metric':32}" + "".join(f"{name:>12}" for name in names)]
    first = columns[names[-1]]
    for task, metrics in first.items():
        for metric in metrics:
            lines.append(f"{f'{task} / {metric}':32}" + "".join(
                f"{columns[name].get(task, {}).get(metric, float('nan')):>12.4f}" for name in names))
    return "\n".join(lines)

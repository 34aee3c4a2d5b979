"""Orchestration of `gpupoor train`: the one place that knows every part. Recipe -> builders -> loop, with
hooks for metrics, progress, checkpoints and time limits."""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.recipe import LoadedRecipe, Recipe, recipe_to_yaml

SMOKE_ROWS = 16
SMOKE_STEPS = 3
SMOKE_MAX_LENGTH = 256


@dataclass
class RunResult:
    run_dir: Path
    reason: str  # "done" | "time_limit"
    final_loss: float | None
    steps: int


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("gpupoor", "torch", "transformers", "peft", "accelerate", "bitsandbytes"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def smoke_recipe(recipe: Recipe) -> Recipe:
    """The same recipe shrunk for `--smoke`: a few rows, a few steps, CPU, fp32, no checkpoints."""
    data = recipe.data.model_copy(update={
        "max_rows": min(recipe.data.max_rows or SMOKE_ROWS, SMOKE_ROWS),
        "max_length": min(recipe.data.max_length, SMOKE_MAX_LENGTH),
        "eval_rows": min(recipe.data.eval_rows, 4)})
    training = recipe.training.model_copy(update={
        "max_steps": SMOKE_STEPS, "epochs": None, "device": "cpu",
        "micro_batch_size": min(recipe.training.micro_batch_size, 2),
        "gradient_accumulation_steps": min(recipe.training.gradient_accumulation_steps, 2),
        "eval_every_steps": None})
    return recipe.model_copy(update={"data": data, "training": training, "precision": "fp32",
                                     "checkpoint": recipe.checkpoint.model_copy(update={"every_steps": None})})


def resolve_run_dir(loaded: LoadedRecipe, output_dir: str | None, stem: str) -> Path:
    if output_dir:  # from the command line: relative to where the user is
        return Path(output_dir).expanduser().resolve()
    if loaded.recipe.output_dir:
        path = Path(loaded.recipe.output_dir).expanduser()
        return path if path.is_absolute() else (loaded.base_dir / path).resolve()
    return (Path.cwd() / "runs" / stem).resolve()


def check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise UserError(f"run directory {run_dir} is not empty; gpupoor never trains over an earlier run",
                        hint="pass --output-dir NEW_DIR (or set output_dir), or delete the old run")


def total_steps(recipe: Recipe, batches_per_epoch: int) -> int:
    if recipe.training.max_steps is not None:
        return recipe.training.max_steps
    epochs = recipe.training.epochs if recipe.training.epochs is not None else 1.0
    return max(1, math.ceil(epochs * batches_per_epoch / recipe.training.gradient_accumulation_steps))


def quiet_libraries() -> None:
    """Silence library noise that says nothing to a user of gpupoor."""
    import logging
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own progress is the one to read
    # peft still asks for the pre-5.x name of the checkpointing flag.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # bitsandbytes tries to fetch an optional CPU kernel from the hub and warns when it can't; it falls back.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def make_accelerator(device: str, precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state; a second run in the same process (the demo, tests, a
    # notebook) with another precision must start from a clean one. Launch settings (DDP etc.) survive.
    AcceleratorState._reset_state()
    return Accelerator(cpu=device == "cpu", mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision])


def train_from_recipe(loaded: LoadedRecipe, output_dir: str | None = None, smoke: bool = False,
                      say=print) -> RunResult:
    import torch

    from gpupoor.checkpoint import write_checkpoint
    from gpupoor.data.build import build_data
    from gpupoor.hardware import resolve_attention, resolve_device, resolve_precision, usable_cpu_count
    from gpupoor.model import build_model, load_tokenizer, model_location, summarize
    from gpupoor.optim import build_optimizer, build_scheduler
    from gpupoor.train.loop import Hooks, LoopSettings, train
    from gpupoor.train.report import MetricsWriter, Progress
    from gpupoor.train.state import TrainState

    quiet_libraries()
    recipe = smoke_recipe(loaded.recipe) if smoke else loaded.recipe
    stem = (loaded.source.stem if loaded.source else "run") + ("-smoke" if smoke else "")
    temporary_run = smoke and not output_dir
    run_dir = Path(tempfile.mkdtemp(prefix="gpupoor-smoke-")) if temporary_run \
        else resolve_run_dir(loaded, output_dir, stem)
    check_run_dir(run_dir)

    device = resolve_device(recipe.training.device)
    precision = resolve_precision(recipe.precision, device.value)
    attention = resolve_attention(recipe.model.attention, device.value)
    if device.value == "cpu":
        # Oversubscribed cores are far slower than idle ones: use the cores we may run on, no more.
        torch.set_num_threads(recipe.training.cpu_threads or usable_cpu_count())
    torch.manual_seed(recipe.seed)

    location = model_location(recipe.model, loaded.base_dir)
    tokenizer = load_tokenizer(location, recipe.model)
    data = build_data(recipe.data, tokenizer, recipe.training.micro_batch_size, recipe.seed, loaded.base_dir)
    stats = data.train.stats
    model = build_model(location, recipe.model, recipe.peft, recipe.quantization, precision.value,
                        attention.value, device.value, recipe.memory.gradient_checkpointing, recipe.seed, smoke)
    summary = summarize(model)
    accelerator = make_accelerator(device.value, precision.value)
    optimizer = build_optimizer(recipe.training, model, device.value)
    steps = total_steps(recipe, len(data.plan))
    scheduler = build_scheduler(recipe.training, optimizer, steps)
    model, optimizer = accelerator.prepare(model, optimizer)

    say(f"gpupoor {'smoke test' if smoke else 'train'}: {recipe.model.name_or_path}"
        + (" (shrunken random-weight copy)" if smoke else ""))
    say(f"  device {device.value} ({device.reason}); precision {precision.value} ({precision.reason}); "
        f"attention {attention.value} ({attention.reason})")
    say(f"  parameters {summary.total_params:,}; trainable {summary.trainable_params:,} "
        f"({summary.trainable_percent:.2f}%); weights {summary.weight_bytes / 2**20:.1f} MiB")
    say(f"  data {stats.kept} examples ({stats.rows} rows; {stats.truncated} truncated to "
        f"{recipe.data.max_length} tokens; {stats.dropped_no_target} without targets dropped); "
        f"{stats.target_tokens / max(stats.tokens, 1):.0%} of tokens are targets"
        + ("; tokenized cache hit" if data.cache_hit else "")
        + (f"; eval {len(data.eval)} examples" if data.eval is not None else ""))
    say(f"  {steps} optimizer steps of {recipe.training.gradient_accumulation_steps} x "
        f"{recipe.training.micro_batch_size} examples; {len(data.plan)} micro-batches per epoch")
    say(f"  run directory {run_dir}")

    run_dir.mkdir(parents=True, exist_ok=True)
    versions = library_versions()
    header = "# resolved recipe written by gpupoor\n" + "".join(f"# {k} {v}\n" for k, v in versions.items())
    (run_dir / "recipe.yaml").write_text(recipe_to_yaml(recipe, header))
    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    progress = Progress(steps, 0, recipe.logging.progress, recipe.logging.every_steps)
    state = TrainState()
    unwrapped = accelerator.unwrap_model(model)
    manifest_extra = {"versions": versions}
    save_seconds = [0.0]
    process_started = time.monotonic()
    last_loss: list[float | None] = [None]

    def save(target: Path, with_optimizer: bool) -> None:
        if accelerator.is_main_process:
            save_seconds[0] = write_checkpoint(target, unwrapped, tokenizer, state,
                                               optimizer if with_optimizer else None,
                                               scheduler if with_optimizer else None, manifest_extra)

    def on_step(record: dict, current: TrainState) -> None:
        last_loss[0] = record["loss"]
        metrics.write(record)
        progress.step(record)
        every = recipe.checkpoint.every_steps
        if every and current.step % every == 0 and current.step < steps:
            save(run_dir / "checkpoints" / f"step-{current.step:06d}", True)
            metrics.write({"step": current.step, "checkpoint": f"step-{current.step:06d}",
                           "save_s": round(save_seconds[0], 3)})

    def on_eval(record: dict, current: TrainState) -> None:
        metrics.write(record)
        progress.message(f"step {record['step']}: eval_loss {record['eval_loss']:.4f}")

    def should_stop(current: TrainState, last_step_s: float) -> str | None:
        limit = recipe.checkpoint.time_limit_s
        if limit is None:
            return None
        # Keep twice the last save time plus one step in reserve, so the checkpoint lands before the deadline.
        reserve = 2 * save_seconds[0] + last_step_s
        return "time_limit" if time.monotonic() - process_started + reserve >= limit else None

    settings = LoopSettings(total_steps=steps, accumulation=recipe.training.gradient_accumulation_steps,
                            max_grad_norm=recipe.training.max_grad_norm,
                            eval_every=recipe.training.eval_every_steps, pad_id=tokenizer.pad_token_id,
                            eval_micro_batch_size=recipe.training.micro_batch_size,
                            eval_in_train_mode=recipe.quantization.bits is not None)
    try:
        reason = train(model, optimizer, scheduler, accelerator, data, state, settings,
                       Hooks(on_step=on_step, on_eval=on_eval, should_stop=should_stop))
    finally:
        progress.close()
        metrics.close()
    if reason == "time_limit":
        name = f"step-{state.step:06d}"
        save(run_dir / "checkpoints" / name, True)
        say(f"time limit {recipe.checkpoint.time_limit} nearly reached: stopped after step {state.step} "
            f"with checkpoint checkpoints/{name}")
    else:
        save(run_dir / "final", False)
        where = "smoke test passed, temporary run removed" if temporary_run else f"adapter in {run_dir / 'final'}"
        say(f"done: {state.step} steps in {state.elapsed_s:.1f} s; final loss {last_loss[0]:.4f}; {where}")
    if temporary_run:
        shutil.rmtree(run_dir, ignore_errors=True)
    return RunResult(run_dir, reason, last_loss[0], state.step)


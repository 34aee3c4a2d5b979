"""What one run is built from: the Session (everything one process built, and its progress) and build_session,
which builds it from the recipe in the order that keeps the RNG stream fixed; with the recipe's own adjustments
(smoke_recipe, total_steps), the launch check and the loop's settings drawn from a session.

Where new things go: a training method is built in gpupoor.model.methods (its rules in decisions.py); a distributed
strategy is chosen in make_accelerator (its rules in decisions.py); a data source or mixture lands in gpupoor/data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.method_table import METHODS
from gpupoor.recipe.schema import Recipe

SMOKE_ROWS = 16
SMOKE_STEPS = 3
SMOKE_MAX_LENGTH = 256
FULL_SHARD_SIZE = "2GB"  # shards of a full fine-tune's checkpoints and final/, as the hub's models are cut


@dataclass
class RunResult:
    run_dir: Path
    reason: str  # "done" | "already_done" | "time_limit" | a signal name
    final_loss: float | None
    steps: int




def check_launch(environ=os.environ) -> None:
    """A launch gpupoor cannot train under is refused before anything loads.

    - DeepSpeed from an accelerate config: see the message.
    - accelerate's own FSDP config: accelerate would wrap the model behind gpupoor's back (gpupoor shards with
      FSDP2 itself when the recipe says distributed.strategy: fsdp, and writes its checkpoints to match).
    - `accelerate launch --num_processes N` without --multi_gpu (e.g. with --cpu) runs accelerate's simple
      launcher: ONE process, which only exports MASTER_ADDR/PORT for an mpirun that is not there. Training
      would silently run on one process; say how to launch N instead."""
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise UserError("this accelerate config launches DeepSpeed, which gpupoor does not train with: DeepSpeed's "
                        "engine steps the optimizer inside backward and keeps its own partitioned optimizer "
                        "state, so gpupoor could neither normalize accumulation by target tokens, skip a "
                        "non-finite step, nor checkpoint and resume the run exactly",
                        hint="use the same sharding through PyTorch: --set distributed.strategy=fsdp (ZeRO-3; with "
                        "distributed.reshard_after_forward=false, like ZeRO-2; distributed.cpu_offload=true, like "
                        "ZeRO-Offload), launched with an accelerate config without deepspeed, or torchrun "
                        "(docs/distributed.md)")
    if environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise UserError("this accelerate config turns on accelerate's FSDP: gpupoor applies FSDP2 itself, so that "
                        "its checkpoints gather the weights and shard the optimizer state to match",
                        hint="launch with an accelerate config without fsdp (or with torchrun) and set "
                        "distributed.strategy: fsdp in the recipe (docs/distributed.md)")
    launched_by_accelerate = "ACCELERATE_USE_CPU" in environ or "ACCELERATE_MIXED_PRECISION" in environ
    ranked = any(key in environ for key in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK"))
    if launched_by_accelerate and "MASTER_ADDR" in environ and not ranked:
        raise UserError("accelerate launch started a single process although more were asked for: without "
                        "--multi_gpu (or with --cpu) it uses its one-process launcher, which expects mpirun",
                        hint="on CPUs: torchrun --nproc-per-node N -m gpupoor train RECIPE; on GPUs: accelerate "
                        "launch --multi_gpu --num_processes N -m gpupoor train RECIPE")


def smoke_recipe(recipe: Recipe) -> Recipe:
    """The same recipe shrunk for `--smoke`: a few rows, a few steps, on the CPU, in the recipe's precision as the
    CPU decides it (fp16, which needs a CUDA GPU: `auto`, see SMOKE_FP16), no checkpoints."""
    few = {"max_rows": min(recipe.data.max_rows or SMOKE_ROWS, SMOKE_ROWS)}
    sources = [source.model_copy(update={"max_rows": min(source.max_rows or SMOKE_ROWS, SMOKE_ROWS),
                                         "eval_rows": min(source.eval_rows, 4), "rows": None, "epochs": None})
               for source in recipe.data.datasets] if recipe.data.datasets else None
    data = recipe.data.model_copy(update={
        **few, "datasets": sources, "max_length": min(recipe.data.max_length, SMOKE_MAX_LENGTH),
        "eval_rows": min(recipe.data.eval_rows, 4)})
    training = recipe.training.model_copy(update={
        "max_steps": SMOKE_STEPS, "epochs": None, "device": "cpu",
        "micro_batch_size": min(recipe.training.micro_batch_size, 2),
        "gradient_accumulation_steps": min(recipe.training.gradient_accumulation_steps, 2),
        "eval_every_steps": None})
    checkpoint = recipe.checkpoint.model_copy(update={"every_steps": None, "every_minutes": None, "time_limit": None})
    model = recipe.model.model_copy(update={"attention": "auto"})  # flash-attn does not run on the CPU
    precision = "auto" if recipe.precision == "fp16" else recipe.precision
    return recipe.model_copy(update={"model": model, "data": data, "training": training, "precision": precision,
                                     "checkpoint": checkpoint})


SMOKE_FP16 = ("the recipe's precision fp16 trains on a CUDA GPU only; the smoke test on the CPU uses precision auto "
              "(bf16 where the CPU has bf16 matrix units, else fp32)")


def total_steps(recipe: Recipe, batches_per_epoch: int, processes: int = 1) -> int:
    from gpupoor.decisions import count_steps

    training = recipe.training
    return count_steps(training.max_steps, training.epochs, training.gradient_accumulation_steps, batches_per_epoch,
                       processes)


def make_accelerator(device: str, precision: str, strategy: str = "single", threads=None):
    """The Accelerator: one process, or several under torchrun / accelerate launch. It prepares DDP itself;
    FSDP is applied by gpupoor.train.distributed.shard_model (accelerate builds FSDP on accelerators only).
    `threads`: the CPU threads Choice, set again after accelerate's start-up (which sets its own for several
    CPU processes when OMP_NUM_THREADS is unset)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state that refuses a second mixed precision. A second run in the same
    # process (the demo, tests, a notebook) must start from a clean one; accelerate has no public reset, so
    # this private call is the one place gpupoor needs it. Launch settings (DDP etc.) come from the
    # environment and survive.
    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=device == "cpu",
                              mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision])
    if strategy == "fsdp" and accelerator.scaler is not None:
        # fp16 under FSDP: each process sees only its shard of the gradients, so whether a step had an inf must
        # be agreed by all of them (else one skips the step and another takes it). ShardedGradScaler does that.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        accelerator.scaler = ShardedGradScaler()
    if threads is not None:
        import torch

        torch.set_num_threads(int(threads.value))
    return accelerator


@dataclass(kw_only=True)
class Session:
    """Everything one process built for a run, and its progress."""

    recipe: Recipe
    run_dir: Path
    smoke: bool
    accelerator: object
    choices: dict  # name -> gpupoor.hardware.Choice (device, precision, attention, sampler)
    tokenizer: object
    data: object  # gpupoor.data.build.DataBundle
    model: object  # as prepared by accelerate
    unwrapped: object
    raw_optimizer: object
    optimizer: object
    steps: int
    warmup: int
    summary: object  # gpupoor.model.build.ModelSummary
    nodes: int = 1
    logged: set = field(default_factory=set)  # (step, kind) of what earlier sessions logged (trackers.already_logged)
    scheduler: object = None
    state: object = None  # gpupoor.train.state.TrainState
    memory_plan: object = None
    teacher: object = None  # the frozen distillation teacher (recipe.distill)
    # What the run directory stores as its recipe when it differs from `recipe`: a resume's --time-limit is this
    # invocation's budget, not the run's (gpupoor.run.orchestrate.resume_run).
    recipe_to_store: Recipe | None = None
    reference: object = None  # DPO's frozen reference copy (preference.reference: copy)
    samples_from: object = None  # GRPO's objective: its latest sampled answers (`samples`) for samples.jsonl
    startup: object = None  # gpupoor.run.startup.StartupClock: where the seconds before the first step went

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> str:
        return self.choices["device"].value

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def sharded(self) -> bool:
        return self.choices["strategy"].value == "fsdp"

    @property
    def full(self) -> bool:
        """`full` fine-tuning: checkpoints and final/ hold the whole model, not an adapter."""
        return not METHODS[self.recipe.peft.method].adapter

    def saved_weight_bytes(self) -> int:
        """About what save_weights writes: the trainable weights (an adapter), or for `full` every weight."""
        return sum(p.numel() * p.element_size() for p in self.unwrapped.parameters() if self.full or p.requires_grad)

    def gather_weights(self) -> dict | None:
        """Under FSDP, the trained weights gathered whole onto the first process (collective); else None: the
        model holds them whole already."""
        if not self.sharded:
            return None
        from gpupoor.train.distributed import gather_weights

        return gather_weights(self.model, whole_model=self.full)

    def save_weights(self, directory: Path, gathered: dict | None = None) -> None:
        """The trained weights in their standard layout: a PEFT adapter, or (full) a transformers model directory
        in safetensors shards that AutoModelForCausalLM.from_pretrained loads with no gpupoor. `gathered`: what
        gather_weights returned (FSDP)."""
        extra = {} if gathered is None else {"state_dict": gathered}
        if self.full:
            self.unwrapped.save_pretrained(directory, max_shard_size=FULL_SHARD_SIZE, **extra)
            _config_dtype_holds_every_weight(directory, self.unwrapped)
        else:
            self.unwrapped.save_pretrained(directory, safe_serialization=True, **extra)  # adapter config + weights
        self.tokenizer.save_pretrained(directory)
        from gpupoor.storage.model_card import weights_card

        # peft's template card names the base by its local path, which the hub refuses: ours names a hub id or none.
        config = getattr(self.unwrapped, "peft_config", {}).get("default")  # the base as the adapter records it
        location = getattr(config, "base_model_name_or_path", None)
        (directory / "README.md").write_text(weights_card(self.recipe.model.name_or_path, self.recipe.peft.method,
                                                          self.full, location), encoding="utf-8")


def _config_dtype_holds_every_weight(directory: Path, model) -> None:
    """A bf16 `full` run that trains some weights (peft.last_layers, modules_to_save) saves them fp32 beside its
    bf16 frozen ones, and transformers writes the first parameter's dtype into config.json: a plain
    from_pretrained(dtype="auto") would round the trained weights to bf16. Say float32 there, which holds both."""
    import torch

    dtypes = {param.dtype for param in model.parameters() if param.is_floating_point()}
    if len(dtypes) < 2 or torch.float32 not in dtypes:
        return
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = "float32"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def import_libraries() -> None:
    """What a run imports before its start-up clock's "libraries" mark (torch, transformers, peft through
    gpupoor's builders), in the run's order: the time plan's child times the same imports (their order changes
    the total: peft first costs seconds more)."""
    import torch  # noqa: F401

    import gpupoor.data.build  # noqa: F401
    import gpupoor.model.build  # noqa: F401
    import gpupoor.train.optim  # noqa: F401
    from gpupoor.quiet import quiet_libraries

    quiet_libraries()


def build_session(recipe: Recipe, run_dir: Path, *, smoke: bool, say, resuming: bool = False,
                  clock=None, trained_in: dict | None = None) -> Session:
    """Hardware choices, tokenizer, data, model and optimizer, in the order that keeps the RNG stream fixed.
    `resuming`: a checkpoint's weights will replace the starting ones (`trained_in`: its manifest). `clock`: a
    gpupoor.run.startup.StartupClock already running (a new one otherwise)."""
    from gpupoor.run.startup import StartupClock

    clock = clock or StartupClock()
    import_libraries()
    import torch

    from gpupoor import faults
    from gpupoor.data.build import build_data
    from gpupoor.decisions import choose_strategy, launch_layout
    from gpupoor.hardware import resolve_attention, resolve_device, resolve_sampler
    from gpupoor.model.build import build_model, summarize
    from gpupoor.model.fast_paths import apply_fast_paths, apply_kernels
    from gpupoor.model.load import load_tokenizer, model_location
    from gpupoor.train.optim import build_optimizer, warmup_steps

    clock.mark("libraries")
    device = resolve_device(recipe.training.device)
    processes, nodes = launch_layout(os.environ)
    # The threads before the precision: the CPU's matmul probe must run at the thread count training will.
    threads = _use_cpu_cores(recipe.training.cpu_threads) if device.value == "cpu" else None
    precision = _decide_precision(recipe, device.value, processes, trained_in)
    attention = resolve_attention(recipe.model.attention, device.value)
    strategy = choose_strategy(recipe.distributed.strategy, processes)
    # The Accelerator first: under `accelerate launch` it says which GPU this process owns.
    accelerator = make_accelerator(device.value, precision.value, strategy.value, threads)
    if not accelerator.is_main_process:
        say = lambda *args, **kwargs: None  # noqa: E731 -- one process reports
    torch.manual_seed(recipe.seed)

    location = model_location(recipe.model, Path.cwd())  # a local directory (built-ins built) or a hub id
    tokenizer = load_tokenizer(location, recipe.model)
    clock.mark("accelerator and tokenizer")
    sampler = resolve_sampler(recipe.data.sampler, attention.value, recipe.model.trust_remote_code,
                              recipe.training.objective)
    data = build_data(recipe.data, tokenizer, micro_batch_size=recipe.training.micro_batch_size, seed=recipe.seed,
                      base_dir=Path.cwd(), sampler=sampler.value, resuming=resuming)
    clock.mark("data")
    for warning in filter(None, [precision.warning, *data.warnings]):
        say(f"warning: {warning}")
    _keep_chat_template(recipe, tokenizer)
    model = build_model(location, recipe.model, recipe.peft, quant=recipe.quantization, memory=recipe.memory,
                        precision=precision.value, attention=attention.value, device=str(accelerator.device),
                        seed=recipe.seed, smoke=smoke, resuming=resuming)
    kernels = apply_kernels(model, recipe.model.kernels, recipe.model.compile)  # first: Liger patches the plain MLP
    fused = apply_fast_paths(model, recipe.model.fused_layers, method=recipe.peft.method, dropout=recipe.peft.dropout,
                             bits=recipe.quantization.bits, precision=precision.value)
    summary = summarize(model)
    built_on = {"precision": precision.value, "attention": attention.value, "device": str(accelerator.device),
                "smoke": smoke}
    teacher = _build_teacher(recipe, tokenizer, **built_on)
    reference = _build_reference(recipe, **built_on)
    clock.mark("model")
    faults.at_stage("startup")  # tests: a signal while the model loads
    if strategy.value == "fsdp":  # before the optimizer: sharding replaces the parameters it must hold
        from gpupoor.train.distributed import shard_model

        dist = recipe.distributed
        model = shard_model(model, precision=precision.value, device=device.value, shard_frozen=dist.shard_frozen,
                            reshard_after_forward=dist.reshard_after_forward, cpu_offload=dist.cpu_offload)
    raw_optimizer = build_optimizer(recipe.training, model, device.value)
    steps = total_steps(recipe, len(data.plan), accelerator.num_processes)
    if strategy.value == "fsdp":
        prepared_model, optimizer = model, accelerator.prepare(raw_optimizer)
    else:
        prepared_model, optimizer = accelerator.prepare(model, raw_optimizer)  # DDP-wrapped with several processes
    clock.mark("optimizer")
    choices = {"device": device, "precision": precision, "attention": attention, "sampler": sampler,
               "strategy": strategy, "fused": fused, "kernels": kernels}
    choices.update({"threads": threads} if threads is not None else {})
    return Session(recipe=recipe, run_dir=run_dir, smoke=smoke, accelerator=accelerator, choices=choices,
                   tokenizer=tokenizer, data=data, model=prepared_model,
                   unwrapped=accelerator.unwrap_model(prepared_model), raw_optimizer=raw_optimizer,
                   optimizer=optimizer, steps=steps, warmup=warmup_steps(recipe.training, steps), summary=summary,
                   nodes=nodes, teacher=teacher, reference=reference, startup=clock)


def _decide_precision(recipe: Recipe, device: str, processes: int, trained_in: dict | None):
    """The precision Choice: what the recipe asks, or for a resume on the CPU what its checkpoint was written in
    (gpupoor.decisions.choose_resumed_precision). Several processes decide on the CPU's flags alone: each
    measuring for itself could disagree."""
    from gpupoor.decisions import Choice, choose_resumed_precision
    from gpupoor.hardware import resolve_precision

    trained = trained_in or {}
    requested = choose_resumed_precision(recipe.precision, device, trained.get("precision"), trained.get("device"))
    precision, _ = resolve_precision(requested.value, device, measure=processes == 1, dims=lambda: _probe_dims(recipe))
    if requested.value != recipe.precision:
        return Choice(precision.value, requested.reason, precision.warning)
    return precision


def _probe_dims(recipe: Recipe) -> tuple[int, int]:
    """The model's (hidden, intermediate) for the CPU's bf16 matmul probe, read from its config as `plan` reads it
    (gpupoor.hardware.PROBE_DIMS where it cannot be read: the model's own errors come when it loads)."""
    from gpupoor.hardware import PROBE_DIMS
    from gpupoor.model.shape import load_shape
    from gpupoor.recipe.loading import LoadedRecipe

    try:
        shape, _ = load_shape(LoadedRecipe(recipe, None))
    except Exception:  # noqa: BLE001 -- a probe's shape is a detail; loading the model says what is wrong
        return PROBE_DIMS
    return shape.hidden, shape.intermediate


def _use_cpu_cores(cpu_threads: int | None):
    """Oversubscribed cores are far slower than idle ones: use the cores we may run on and that are free at start,
    shared with the other processes of this node (training.cpu_threads, when set, decides). The Choice."""
    import torch

    from gpupoor.decisions import choose_cpu_threads
    from gpupoor.hardware import busy_cpu_cores, usable_cpu_count

    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # Several processes of one launch start together and would count each other as busy: only one asks.
    busy = busy_cpu_cores() if cpu_threads is None and processes == 1 else None
    choice = choose_cpu_threads(cpu_threads, usable_cpu_count(), processes, busy)
    torch.set_num_threads(int(choice.value))
    return choice


def _keep_chat_template(recipe: Recipe, tokenizer) -> None:
    """The tokenizer saved beside the adapter carries the template the run trained with (a named one resolved to
    its text), so generate, merges and plain transformers render prompts the same way."""
    from gpupoor.data.row_formats import FORMATS

    chat_source = next((s for s in recipe.data.sources() if FORMATS[s.format].needs_chat_template), None)
    if chat_source is not None:
        from gpupoor.data.build import make_encoder

        tokenizer.chat_template = make_encoder(recipe.data, tokenizer, chat_source).chat_template


def _build_teacher(recipe: Recipe, tokenizer, *, precision: str, attention: str, device: str, smoke: bool):
    """The frozen distillation teacher (recipe.distill), checked to share the student's vocabulary; or None."""
    if recipe.distill is None:
        return None
    from gpupoor.objectives.distill import check_vocabularies
    from gpupoor.model.frozen import build_teacher

    teacher, teacher_tokenizer = build_teacher(recipe.distill, recipe.model, precision=precision, attention=attention,
                                               device=device, seed=recipe.seed, smoke=smoke)
    check_vocabularies(tokenizer, teacher_tokenizer)
    return teacher


def _build_reference(recipe: Recipe, *, precision: str, attention: str, device: str, smoke: bool):
    """DPO's frozen reference copy of the base model when the reference is a copy (gpupoor.decisions
    .choose_reference), else None."""
    from gpupoor.decisions import choose_reference

    preference = recipe.preference
    if choose_reference(recipe.training.objective, preference.reference, recipe.peft.method).value != "copy":
        return None
    from gpupoor.model.frozen import build_reference

    return build_reference(recipe.model, bits=preference.reference_bits, quant=recipe.quantization,
                           precision=precision, attention=attention, device=device, seed=recipe.seed, smoke=smoke)


def loop_settings(session: Session, loss=None):
    """The loop's settings for this session: its steps, accumulation, eval, and the objective's loss as
    gpupoor.objectives.choose.choose_loss chose it (None: the settings alone, for when an eval is due)."""
    from gpupoor.decisions import evaluates_in_train_mode
    from gpupoor.train.loop import LoopSettings

    training = session.recipe.training
    chosen = {} if loss is None else {
        "loss_fn": loss.loss_fn, "eval_fn": loss.eval_fn, "count_units": loss.count_units,
        "metric_names": loss.metric_names, "eval_metric_names": loss.eval_metric_names,
        "window_repeats": loss.window_repeats}
    return LoopSettings(total_steps=session.steps, accumulation=training.gradient_accumulation_steps,
                        max_grad_norm=training.max_grad_norm, eval_every=training.eval_every_steps,
                        pad_id=session.tokenizer.pad_token_id, eval_micro_batch_size=training.micro_batch_size,
                        eval_in_train_mode=evaluates_in_train_mode(session.recipe.quantization.bits, session.device),
                        max_consecutive_skips=training.max_consecutive_skips, lockstep=session.sharded, **chosen)

"""The recipe's cross-field rules: checks that relate several keys or sections, which no single field can make.

The schema (gpupoor.recipe.schema) calls each rule from a `model_validator(mode="after")`, which sees the whole
validated section or recipe. A pydantic `field_validator` that read the other fields through `info.data` would see
only the fields declared before its own, so moving a field would silently switch its rule off (and assigning the
other field would skip it); none does. Rules take the validated sections and raise ValueError (pydantic reports
it); check_rows and check_tokenized_settings relate the recipe to facts about its data, found later, and raise
UserError. Imports no torch and nothing of the schema (the schema imports this).
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from gpupoor.decisions import choose_reference
from gpupoor.errors import UserError
from gpupoor.method_table import ADAPTER_METHODS, METHODS
from gpupoor.objective_table import OBJECTIVES, ROWS
from gpupoor.optimizers import FSDP_OPTIMIZERS

# A source's amount per epoch (`rows`, `epochs`) is at most this many passes over it: an epoch's order is held in
# memory, and more repetition of one source is what training.epochs (every source again) is for.
MAX_PASSES = 100


def check_source(source) -> None:
    """One source of data.datasets (a SourceSection): one amount, one evaluation source."""
    amounts = [name for name in ("weight", "rows", "epochs") if getattr(source, name) is not None]
    if len(amounts) > 1:
        raise ValueError(f"set one of weight, rows and epochs for a source, not {' and '.join(amounts)}")
    if source.eval_rows and source.eval_path:
        raise ValueError("choose one evaluation source per data source, not eval_rows and eval_path")


def check_data(data) -> None:
    """The data section (a DataSection): one training source and at most one evaluation source."""
    sources = [n for n, v in (("eval_path", data.eval_path), ("eval_split", data.eval_split),
                              ("eval_rows", data.eval_rows)) if v]
    if len(sources) > 1:
        raise ValueError(f"choose one evaluation source, not {' and '.join(sources)}")
    given = [n for n in ("path", "datasets", "tokenized_path") if getattr(data, n)]
    if len(given) != 1:
        raise ValueError("data.path, data.datasets or data.tokenized_path: set exactly one" +
                         (f", not {' and '.join(given)}" if given else " (the training data)"))
    if data.datasets:
        weighted = [source.weight is not None for source in data.datasets]
        if any(weighted) and not all(weighted):
            raise ValueError("data.datasets: give every source a weight, or none (then each source uses rows, "
                             "epochs, or one pass)")
        if data.eval_path or data.eval_split or data.eval_rows:
            raise ValueError("data.datasets: set eval_path (or eval_rows) on each source; data.eval_path, "
                             "data.eval_split and data.eval_rows belong to a single `path`")


def check_peft(peft) -> None:
    """The peft section (a PeftSection): settings that belong to other methods."""
    method = METHODS[peft.method]
    if method.adapter and not method.low_rank and peft.dropout:
        raise ValueError(f"peft.dropout is a setting of the low-rank methods "
                         f"({', '.join(m.name for m in METHODS.values() if m.low_rank)}); {peft.method} has no dropout")


def check_recipe(recipe) -> None:
    """The rules across sections of a Recipe, in the order they are reported when several fail."""
    _no_quantized_full_tuning(recipe.peft, recipe.quantization)
    _fsdp_combinations(recipe.distributed, recipe.training, recipe.memory)
    _evaluation_that_decides(recipe.data, recipe.training, recipe.checkpoint)
    _preference_combinations(recipe)


def _refuse_at(key: str, value: object, message: str) -> NoReturn:
    """Report `message` at `key` (a section), as a validator of that field would: the error then names the
    key's file:line and its value. A model validator's ValueError has no location; pydantic keeps the locations
    of a ValidationError raised in one."""
    error = PydanticCustomError("value_error", "Value error, {reason}", {"reason": message})
    raise ValidationError.from_exception_data("Recipe", [InitErrorDetails(type=error, loc=(key,), input=value)])


def _no_quantized_full_tuning(peft, quantization) -> None:
    if not METHODS[peft.method].adapter and quantization.bits is not None:
        _refuse_at("quantization", quantization.model_dump(exclude_unset=True),
                   "a quantized base cannot be fully fine-tuned (peft.method: full): bitsandbytes weights do not "
                   f"train. Use {ADAPTER_METHODS} on a quantized base (QLoRA), or unset quantization.bits")


def _fsdp_combinations(distributed, training, memory) -> None:
    if distributed.strategy != "fsdp":
        return
    if training.optimizer not in FSDP_OPTIMIZERS:
        raise ValueError(f"distributed.strategy fsdp cannot step training.optimizer {training.optimizer}: its "
                         "update kernels do not run on FSDP2's sharded (DTensor) parameters. Use optimizer "
                         f"{' or '.join(FSDP_OPTIMIZERS)} with fsdp (sharding already splits the optimizer "
                         "state), or strategy ddp with the 8-bit or factored optimizer")
    if memory.max_gpu_memory is not None:
        raise ValueError("distributed.strategy fsdp and memory.max_gpu_memory both place the weights: FSDP "
                         "shards them across processes and cannot also stream them from CPU. Unset "
                         "memory.max_gpu_memory (fsdp's cpu_offload keeps shards in CPU memory instead)")


def _evaluation_that_decides(data, training, checkpoint) -> None:
    has_eval = bool(data.eval_path or data.eval_split or data.eval_rows
                    or any(source.eval_rows or source.eval_path for source in data.datasets or []))
    if training.early_stopping_patience is not None and not (has_eval and training.eval_every_steps):
        raise ValueError("training.early_stopping_patience needs evaluations to count: set data.eval_rows (or "
                         "data.eval_path / data.eval_split) and training.eval_every_steps")
    if checkpoint.keep_best and not has_eval:
        raise ValueError("checkpoint.keep_best needs an eval loss to rank checkpoints: set data.eval_rows (or "
                         "data.eval_path / data.eval_split)")
    if checkpoint.final == "best" and not checkpoint.keep_best:
        raise ValueError("checkpoint.final: best needs checkpoint.keep_best: true (the best checkpoint is kept "
                         "to be copied into final/)")


def _preference_combinations(recipe) -> None:
    """Pairs and the preference objectives go together; what they cannot be combined with."""
    data, objective = recipe.data, recipe.training.objective
    formats = {source.format for source in data.sources()}
    kind = OBJECTIVES[objective]
    if kind.data == ROWS:
        if "preference" in formats:
            pairs = [o.name for o in OBJECTIVES.values() if o.pairs]
            raise ValueError(f"data.format preference holds pairs for a preference objective, and "
                             f"training.objective is {objective}: set training.objective: {pairs[0]} (or "
                             f"{', '.join(pairs[1:])}), or use a format of single answers")
        return
    if kind.samples:
        _grpo_combinations(recipe, formats)
        return
    if data.tokenized_path:
        raise ValueError(f"training.objective {objective} cannot read data.tokenized_path yet: give the pairs "
                         "as data.path (or data.datasets) with format: preference (they are cached tokenized)")
    if formats != {"preference"}:
        where = "data.datasets[].format" if data.datasets else "data.format"
        raise ValueError(f"training.objective {objective} trains on preference pairs: set {where}: preference "
                         f"(prompt, chosen, rejected), not {', '.join(sorted(formats - {'preference'}))}")
    if recipe.distill is not None:
        raise ValueError(f"training.objective {objective} and distill are two different losses: remove the "
                         "distill section, or train with objective sft")
    if data.train_on_prompt:
        raise ValueError(f"data.train_on_prompt does not apply to a preference objective ({objective}): it compares "
                         "the answers' log-probabilities, and the prompt is never trained. Remove it")
    _reference_settings(objective, recipe.preference, recipe.peft)


# Formats whose rows have a prompt side to sample answers to (`text` is all answer; `tokenized` has no text).
PROMPTED_FORMATS = ("alpaca", "chat", "sharegpt", "completion")


def _grpo_combinations(recipe, formats: set[str]) -> None:
    """GRPO samples answers to the data's prompts: a format with prompts, rows one prompt each (never packed), the
    reference (for beta > 0) as the adapter switched off."""
    data, grpo = recipe.data, recipe.grpo
    where = "data.datasets[].format" if data.datasets else "data.format"
    if data.tokenized_path or not formats <= set(PROMPTED_FORMATS):
        given = "tokenized" if data.tokenized_path else ", ".join(sorted(formats - set(PROMPTED_FORMATS)))
        raise ValueError(f"training.objective grpo samples answers to the data's prompts, and {given} rows have "
                         f"none: set {where} to one of {', '.join(PROMPTED_FORMATS)} (a prompt and its expected "
                         "answer)")
    if data.sampler == "packed":
        raise ValueError("data.sampler packed does not apply to training.objective grpo: each row is one prompt "
                         "its answers are sampled to; use random or length_grouped (auto chooses length_grouped)")
    if data.train_on_prompt:
        raise ValueError("data.train_on_prompt does not apply to training.objective grpo: it trains on sampled "
                         "answers only. Remove it")
    if recipe.distributed.strategy == "fsdp":
        raise ValueError("distributed.strategy fsdp does not apply to training.objective grpo yet: sampling runs "
                         "the model a different number of times on each process, and FSDP's forwards are "
                         "collective. Use ddp (or auto)")
    if recipe.distill is not None:
        raise ValueError("training.objective grpo and distill are two different losses: remove the distill "
                         "section, or train with objective sft")
    if grpo.beta and not METHODS[recipe.peft.method].adapter:
        raise ValueError("grpo.beta > 0 needs a reference, which gpupoor takes as the base with the adapter "
                         "switched off, and peft.method full trains no adapter: set grpo.beta: 0, or train an "
                         "adapter (lora, dora, ia3)")
    if grpo.beta and recipe.peft.init_adapter:
        raise ValueError("grpo.beta > 0 would switch the adapter off, leaving the base without peft.init_adapter "
                         "as the reference, not the model you start from: merge that adapter into the base "
                         "first (gpupoor merge-lora), or set grpo.beta: 0")
    if grpo.epsilon_high is not None and grpo.epsilon_high < grpo.epsilon:
        raise ValueError(f"grpo.epsilon_high {grpo.epsilon_high:g} is below grpo.epsilon {grpo.epsilon:g}: the "
                         "clip from above is at least the one from below (DAPO's clip-higher raises it)")


def _reference_settings(objective: str, preference, peft) -> None:
    """DPO's reference as gpupoor.decisions.choose_reference decides it (the rule training and plan follow), and
    the keys that only apply to some references or losses."""
    try:
        reference = choose_reference(objective, preference.reference, peft.method).value
    except UserError as exc:  # adapter_off with `full`: no adapter to switch off
        raise ValueError(f"{exc.message}: {exc.hint}") from None
    if reference == "adapter_off" and preference.reference == "auto" and peft.init_adapter:
        raise ValueError("preference.reference auto would switch the adapter off, leaving the base model "
                         "without peft.init_adapter as DPO's reference, not the model you start from: merge that "
                         "adapter into the base first (gpupoor merge-lora) and train a new one on the merged "
                         "model, or set preference.reference: adapter_off (or copy) to accept the base as "
                         "the reference")
    if objective == "dpo" and preference.label_smoothing and preference.loss_type != "sigmoid":
        raise ValueError(f"preference.label_smoothing applies to preference.loss_type sigmoid (conservative "
                         f"DPO); {preference.loss_type} has no smoothed form: remove label_smoothing, or use "
                         "loss_type sigmoid")
    if preference.reference_bits is not None and reference != "copy":
        raise ValueError("preference.reference_bits quantizes a reference copy, and this recipe has none "
                         + ("(ORPO needs no reference)" if objective == "orpo" else
                            "(the reference is the model with its adapter switched off)")
                         + ": remove it, or set preference.reference: copy")


def check_rows(key: str, rows: int, size: int, what: str = "examples") -> None:
    """A source's `rows` per epoch are at most MAX_PASSES passes over its `size` (the epoch's order is held in
    memory: a typo's 1e12 would grow it without end). validate counts rows; training, examples."""
    if rows > MAX_PASSES * size:
        raise UserError(f"{key}: {rows:,} examples per epoch is more than {MAX_PASSES} passes over the source's "
                        f"{size:,} {what}", hint=f"give at most {MAX_PASSES * size:,} (or use weights); to see all the "
                        "data more often, raise training.epochs")


def check_tokenized_settings(manifest: dict, data, path: Path) -> None:
    """The recipe's data.max_length and data.format (`data`: its DataSection) must be those the `gpupoor tokenize`
    directory `path` (its manifest) was made with: its examples were cut and labelled then, so a recipe that says
    otherwise would describe a run it is not (a UserError naming both)."""
    made = {"max_length": manifest.get("max_length"), "format": (manifest.get("data") or {}).get("format")}
    differences = [(key, getattr(data, key), made[key]) for key in ("max_length", "format")
                   if made[key] is not None and getattr(data, key) != made[key]]
    if not differences:
        return
    said = "; ".join(f"data.{key} is {ours!r} in the recipe but {theirs!r} in its manifest"
                     for key, ours, theirs in differences)
    raise UserError(f"data.tokenized_path: {path} was tokenized with other settings ({said}); its examples were "
                    "cut and labelled when it was written, so the recipe's values would be ignored",
                    hint="set " + " and ".join(f"data.{key}: {theirs}" for key, _, theirs in differences)
                    + " in the recipe, or tokenize again with the new settings (gpupoor tokenize RECIPE --output DIR)")


def check_model(model) -> None:
    """model.gguf_file names a .gguf file inside the directory model.name_or_path, which is then no file itself."""
    if model.gguf_file is not None and not model.gguf_file.lower().endswith(".gguf"):
        raise UserError(f"model.gguf_file: {model.gguf_file!r} is not a .gguf file name",
                        hint="name the GGUF file inside the directory model.name_or_path")
    if model.gguf_file is not None and model.name_or_path.lower().endswith(".gguf"):
        raise UserError("model.gguf_file: model.name_or_path already names a .gguf file",
                        hint="set one: the file in model.name_or_path, or its directory there and the file here")

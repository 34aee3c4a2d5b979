"""The recipe: one pydantic schema, validated once at the edge, plus YAML loading with `--set` overrides.

Every field is documented here, once; `gpupoor schema` and docs/recipe.md are generated from these
descriptions. This module imports no torch, so `gpupoor validate` and `--help` stay fast.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpupoor.errors import UserError
from gpupoor.optimizers import FSDP_OPTIMIZERS, OPTIMIZER_NAMES, optimizers_doc
from gpupoor.units import MiB, parse_duration, parse_size


# Marks a key a resume may change: it says how long to train, when to save, what to print or where to evaluate,
# not what the trajectory is. Any key without it changes the trajectory (refused on resume unless --force).
# A whole section is marked on its field in Recipe. gpupoor.recipe.diff reads these marks.
RESUME_SAFE: dict = {"json_schema_extra": {"resume": "safe"}}


def is_resume_safe(field) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("resume") == "safe"


class _Section(BaseModel):
    # allow_inf_nan=False: `.inf` / `.nan` in YAML is a schema error on every float key, not a NaN loss later.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelSection(_Section):
    """Which base model to fine-tune and how to load it."""

    name_or_path: str = Field(
        description="Hugging Face hub id (e.g. `Qwen/Qwen2.5-1.5B`) or a local directory saved with "
        "`save_pretrained`. Relative paths resolve against the recipe file."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) to load.")
    trust_remote_code: bool = Field(
        False, description="Run model code shipped in the model repository. Off unless you trust it."
    )
    attention: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto",
        description="Attention backend. `auto` picks flash_attention_2 when flash-attn imports and the GPU "
        "supports it (compute capability >= 8), else sdpa. The startup summary says what was chosen and why.",
    )


DATA_FORMATS = ("text", "alpaca", "chat", "sharegpt", "completion", "tokenized", "preference")
DataFormat = Literal["text", "alpaca", "chat", "sharegpt", "completion", "tokenized", "preference"]
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}


# A source's amount per epoch (`rows`, `epochs`) is at most this many passes over it: an epoch's order is held in
# memory, and more repetition of one source is what training.epochs (every source again) is for.
MAX_PASSES = 100


class SourceSection(_Section):
    """One source of a mixture (`data.datasets`). Keys left unset take the `data` section's value."""

    path: str = Field(description="A file, a `save_to_disk` directory or a hub dataset, as `data.path`.")
    name: str | None = Field(None, description="The source's name in the summary and metrics. Default: the file "
                             "or dataset name.")
    format: DataFormat | None = Field(None, description="As `data.format`; default `data.format`.")
    split: str | None = Field(None, description="As `data.split`.")
    text_field: str | None = Field(None, description="As `data.text_field`.")
    messages_field: str | None = Field(None, description="As `data.messages_field`.")
    conversations_field: str | None = Field(None, description="As `data.conversations_field`.")
    max_rows: int | None = Field(None, ge=1, description="Use only the first N rows of this source.")
    weight: float | None = Field(
        None, gt=0, description="The source's share of each epoch of the mixture, relative to the other sources' "
        "weights (set it on every source or on none). An epoch holds as many examples as all sources together; "
        "a source with more weight than examples repeats them."
    )
    rows: int | None = Field(None, ge=1, description="Exactly this many examples of this source per epoch: at most "
                             f"{MAX_PASSES} passes over it (validate counts its rows).")
    epochs: float | None = Field(None, gt=0, le=MAX_PASSES, description="Passes over this source per epoch (0.5: "
                                 f"half of it, 2: each example twice; at most {MAX_PASSES}). Default 1 when neither "
                                 "`weight` nor `rows` is set.")
    eval_rows: int = Field(0, ge=0, description="Hold out this many rows of this source for eval.")
    eval_path: str | None = Field(None, description="This source's eval data, in its format.")

    @model_validator(mode="after")
    def _one_amount(self) -> "SourceSection":
        amounts = [name for name in ("weight", "rows", "epochs") if getattr(self, name) is not None]
        if len(amounts) > 1:
            raise ValueError(f"set one of weight, rows and epochs for a source, not {' and '.join(amounts)}")
        if self.eval_rows and self.eval_path:
            raise ValueError("choose one evaluation source per data source, not eval_rows and eval_path")
        return self


class DataSection(_Section):
    """What to train on and how to turn rows into tokens: one source (`path`) or a mixture (`datasets`)."""

    path: str | None = Field(
        None, description="A local .jsonl/.json/.csv/.parquet file, a directory written by "
        "`datasets.save_to_disk`, or a hub dataset name (needs network). Relative paths resolve against "
        "the recipe file. One of `path`, `datasets` and `tokenized_path`."
    )
    datasets: list[SourceSection] | None = Field(
        None, description="A mixture: several sources, each with its own path, format, split, field names and "
        "amount (`weight`, `rows` or `epochs`). The mixture of every epoch is a function of (seed, epoch), so a "
        "run resumes in the middle of it exactly."
    )
    tokenized_path: str | None = Field(
        None, description="A directory `gpupoor tokenize` wrote: the training (and eval) data already tokenized, "
        "memory-mapped, for reuse by many runs or nodes."
    )
    format: DataFormat = Field(
        "text",
        description="`text`: a `text` field trained as a completion. `alpaca`: `instruction`, optional "
        "`input`, `output`, in the Alpaca prompt template; loss on `output`. `chat`: a `messages` list of "
        "{role, content} rendered with the chat template; loss on assistant turns. `sharegpt`: a "
        "`conversations` list of {from, value} (roles by `sharegpt_roles`: human, gpt, system...), rendered like "
        "`chat`. `completion`: `prompt` and `completion` strings joined as they are (TRL's prompt-completion "
        "format); loss on `completion`. `tokenized`: rows that hold `input_ids` and `labels` (-100 where not "
        "trained) or a 0/1 `loss_mask`, used as they are. `preference`: pairs for `training.objective: dpo` or "
        "`orpo`: `prompt`, `chosen` and `rejected`, three strings (the prompt, then each answer, joined as they "
        "are) or message lists rendered with the chat template (without `prompt`, the messages chosen and "
        "rejected share are the prompt); log-probabilities on the answers only (docs/preference.md).",
    )
    split: str = Field("train", description="Split to read from a hub dataset or a saved DatasetDict.")
    text_field: str = Field("text", description="Field holding the text for `format: text`.")
    messages_field: str = Field("messages", description="Field holding the message list for `format: chat`.")
    conversations_field: str = Field("conversations", description="Field holding the turns for `format: sharegpt`.")
    sharegpt_roles: dict[str, Literal["system", "user", "assistant", "tool"]] = Field(
        default_factory=lambda: dict(SHAREGPT_ROLES),
        description="ShareGPT `from` values and the chat role each one is."
    )
    chat_template: str | None = Field(
        None, description="For `chat` and `sharegpt`: a template name (`llama3`, `chatml`, `gemma`, `mistral`, "
        "`phi3`) or a Jinja template. Default: the tokenizer's own; a tokenizer without one needs this set."
    )
    max_length: int = Field(
        2048, ge=8, description="Tokens per example (a preference pair: per sequence, the prompt with one answer); "
        "longer examples are truncated and counted."
    )
    sampler: Literal["auto", "random", "length_grouped", "packed"] = Field(
        "auto",
        description="`auto`: `packed` where packing is exact (transformers' own model code with sdpa, eager "
        "or flash-attention 2), else `length_grouped`. `random`: a fresh shuffle each epoch, padded batches. "
        "`length_grouped`: shuffled, then "
        "examples of similar length batched together to cut padding. `packed`: whole examples bin-packed "
        "(first-fit-decreasing over shuffled windows of 1000) into rows of at most micro_batch_size x "
        "max_length tokens with no padding; attention never crosses examples. All are deterministic from "
        "(seed, epoch) and resume in O(1).",
    )
    train_on_prompt: bool = Field(
        False, description="Also compute the loss on prompts / user turns, not only on completions."
    )
    max_rows: int | None = Field(None, ge=1, description="Use only the first N rows of the training data.")
    eval_path: str | None = Field(
        None, description="Evaluation data in the same format: a file, a saved dataset or a hub name.", **RESUME_SAFE
    )
    eval_split: str | None = Field(
        None, description="Evaluate on this split of `path` (hub dataset or saved DatasetDict).", **RESUME_SAFE
    )
    eval_rows: int = Field(
        0, ge=0, description="Hold out this many rows of the training data (after a seeded shuffle) for eval."
    )
    cache_dir: str | None = Field(
        None,
        description="Where tokenized data is cached (default `$GPUPOOR_CACHE` or `~/.cache/gpupoor`). The "
        "cache key covers the data bytes, tokenizer files, template, format and max_length.", **RESUME_SAFE,
    )

    def describe(self) -> str:
        """Where the training data comes from, in a few words (status, reports)."""
        if self.tokenized_path:
            return f"tokenized data in {self.tokenized_path}"
        if not self.datasets:
            return str(self.path)

        def amount(source: SourceSection) -> str:
            return (f"weight {source.weight:g}" if source.weight is not None else f"{source.rows} rows"
                    if source.rows is not None else f"{source.epochs or 1:g} epochs")

        return "mixture of " + ", ".join(f"{source.name} ({amount(source)})" for source in self.sources())

    def sources(self) -> list["SourceSection"]:
        """The training sources with every unset key taken from this section: `datasets`, or `path` as a
        mixture of one (named `data`). Names are unique (a repeated stem gets -2, -3)."""
        inherited = ("format", "split", "text_field", "messages_field", "conversations_field")
        if self.datasets is None:
            if self.path is None:
                return []
            return [SourceSection(path=self.path, name="data", max_rows=self.max_rows, eval_rows=self.eval_rows,
                                  eval_path=self.eval_path, **{key: getattr(self, key) for key in inherited})]
        resolved, seen = [], {}
        for source in self.datasets:
            stem = source.name or Path(source.path.rstrip("/")).stem or source.path
            seen[stem] = seen.get(stem, 0) + 1
            name = stem if seen[stem] == 1 else f"{stem}-{seen[stem]}"  # (tracker keys take no #)
            updates = {key: getattr(self, key) for key in inherited if getattr(source, key) is None}
            resolved.append(source.model_copy(update={**updates, "name": name}))
        return resolved

    @model_validator(mode="after")
    def _one_eval_source(self) -> "DataSection":
        sources = [n for n, v in (("eval_path", self.eval_path), ("eval_split", self.eval_split),
                                  ("eval_rows", self.eval_rows)) if v]
        if len(sources) > 1:
            raise ValueError(f"choose one evaluation source, not {' and '.join(sources)}")
        given = [n for n in ("path", "datasets", "tokenized_path") if getattr(self, n)]
        if len(given) != 1:
            raise ValueError("data.path, data.datasets or data.tokenized_path: set exactly one" +
                             (f", not {' and '.join(given)}" if given else " (the training data)"))
        if self.datasets:
            weighted = [source.weight is not None for source in self.datasets]
            if any(weighted) and not all(weighted):
                raise ValueError("data.datasets: give every source a weight, or none (then each source uses rows, "
                                 "epochs, or one pass)")
            if self.eval_path or self.eval_split or self.eval_rows:
                raise ValueError("data.datasets: set eval_path (or eval_rows) on each source; data.eval_path, "
                                 "data.eval_split and data.eval_rows belong to a single `path`")
        return self


def check_rows(key: str, rows: int, size: int, what: str = "examples") -> None:
    """A source's `rows` per epoch are at most MAX_PASSES passes over its `size` (the epoch's order is held in
    memory: a typo's 1e12 would grow it without end). validate counts rows; training, examples."""
    if rows > MAX_PASSES * size:
        raise UserError(f"{key}: {rows:,} examples per epoch is more than {MAX_PASSES} passes over the source's "
                        f"{size:,} {what}", hint=f"give at most {MAX_PASSES * size:,} (or use weights); to see all the "
                        "data more often, raise training.epochs")


def check_tokenized_settings(manifest: dict, data: DataSection, path: Path) -> None:
    """The recipe's data.max_length and data.format must be those the `gpupoor tokenize` directory `path` (its
    manifest) was made with: its examples were cut and labelled then, so a recipe that says otherwise would
    describe a run it is not (a UserError naming both)."""
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


class PeftSection(_Section):
    """What trains: adapters on the frozen base model (LoRA, DoRA, IA3), or the model's own weights (full), on
    every decoder layer or only the last few."""

    method: Literal["lora", "dora", "ia3", "full"] = Field(
        "lora", description="`lora`: low-rank adapters (rank, alpha, dropout). `dora`: LoRA with a learned "
        "magnitude per output (peft's use_dora; closer to full tuning; a per-step weight norm makes it slower). `ia3`: learned "
        "scales on attention keys/values and the MLP's down projection (far fewer parameters than LoRA). "
        "`full`: the model's own weights train (checkpoints and final/ hold the whole model; pair it with "
        "8-bit AdamW and gradient checkpointing on small hardware; no quantized base)."
    )
    last_layers: int | None = Field(
        None, ge=1, description="Adapt (with `full`: train) only the last N decoder layers. The layers below stay "
        "frozen and keep no activations for backward, so memory and time fall with N."
    )
    rank: int = Field(16, ge=1, le=4096, description="LoRA rank r.")
    alpha: float | None = Field(
        None, gt=0, description="LoRA alpha; the update is scaled by alpha / rank. Default: 2 x rank."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt (e.g. `[q_proj, v_proj]`), or `all-linear` for every linear "
        "layer except the output head. For `ia3`, `all-linear` means peft's IA3 defaults for the architecture "
        "(Llama family: k_proj, v_proj, down_proj). Not used by `full`.",
    )
    init_adapter: str | None = Field(
        None, description="Start from this adapter's weights instead of fresh ones: a gpupoor run's final/ (or a "
        "checkpoint), or any PEFT adapter directory of the same method. Continued training or a second stage, "
        "QLoRA included; the stored recipe keeps the path."
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full (e.g. `[lm_head, embed_tokens]`): saved with the adapter, or with "
        "`full`, the modules that train besides `last_layers` (with neither set, every module trains).",
    )

    @field_validator("target_modules", "modules_to_save")
    @classmethod
    def _named_modules(cls, value):
        # An empty name passes every check of the config's module names and then matches nothing in the model.
        if isinstance(value, list) and any(not name.strip() for name in value):
            raise ValueError("an empty module name matches no module; name modules such as q_proj, lm_head or "
                             "embed_tokens, or leave the list out")
        return value

    @model_validator(mode="after")
    def _method_settings(self) -> "PeftSection":
        if self.method == "ia3" and self.dropout:
            raise ValueError("peft.dropout is a LoRA/DoRA setting; IA3 has no dropout")
        return self

    @property
    def effective_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class DistillSection(_Section):
    """Knowledge distillation: the student (any peft.method) also learns the token distributions of a larger
    teacher on the training data: loss = weight * T^2 * KL(teacher_T || student_T) + (1 - weight) * CE."""

    teacher: str = Field(
        description="The teacher: hub id or local directory (relative paths resolve against the recipe). It must "
        "use the student's tokenizer (the same vocabulary ids)."
    )
    revision: str | None = Field(None, description="Hub revision of the teacher.")
    temperature: float = Field(2.0, gt=0, description="Softens both distributions; the KL term is scaled by T^2.")
    weight: float = Field(0.5, ge=0, le=1, description="Share of the KL term; the rest is the usual cross-entropy.")
    bits: Literal[4, 8] | None = Field(None, description="Load the frozen teacher quantized (bitsandbytes) to fit "
                                       "beside the student.")


class PreferenceSection(_Section):
    """Preference tuning (`training.objective: dpo` or `orpo`) on `data.format: preference` pairs: the loss and its
    knobs, and where DPO's reference log-probabilities come from. Unused by `sft`."""

    beta: float = Field(
        0.1, gt=0, description="DPO's beta: the scale of the implicit reward beta * (log pi - log pi_ref); larger "
        "keeps the policy closer to the reference. For `loss_type: ipo` it is IPO's tau (the target margin is "
        "1 / (2 beta))."
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="DPO's loss of the reward margin m: `sigmoid` -log sigmoid(beta m) (the paper's), "
        "`ipo` (m per answer token - 1 / (2 beta))^2, `hinge` relu(1 - beta m) (SLiC)."
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="`sigmoid` only: the share of pairs assumed to be mislabelled (conservative "
        "DPO): -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m)."
    )
    orpo_lambda: float = Field(
        0.1, gt=0, description="ORPO's lambda (TRL's ORPOConfig.beta): the weight of the odds-ratio term beside the "
        "chosen answer's cross-entropy."
    )
    reference: Literal["auto", "adapter_off", "copy"] = Field(
        "auto", description="DPO's frozen reference model. `adapter_off`: the model being trained with its adapter "
        "switched off (peft's disable_adapter), in the same micro-batch: no second copy in memory. `copy`: a "
        "frozen copy of the base model loaded beside it (quantizable with `reference_bits`). `auto`: "
        "`adapter_off` when an adapter trains, `copy` for `peft.method: full`."
    )
    reference_bits: Literal[4, 8] | None = Field(
        None, description="Load the reference copy quantized (bitsandbytes) to fit beside the trained model; "
        "`reference: copy` (or `full` with `auto`) only. Its log-probabilities shift a little. With the bits of "
        "`quantization.bits` it takes that section's settings (quant_type, double_quant, compute_dtype): the very "
        "base the policy trains on; other bits use nf4 with double quantization."
    )


class QuantizationSection(_Section):
    """Load the frozen base model quantized with bitsandbytes (4-bit + LoRA = QLoRA)."""

    bits: Literal[4, 8] | None = Field(None, description="4 or 8 to quantize the base weights; unset for none.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="Quantize the 4-bit quantization constants too (saves ~0.4 bit/param).")
    compute_dtype: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="dtype of 4-bit matmuls; `auto` follows `precision`."
    )


class TrainingSection(_Section):
    """Batching, schedule and stopping."""

    objective: Literal["sft", "dpo", "orpo"] = Field(
        "sft", description="What the model learns. `sft`: the cross-entropy of the target tokens (supervised "
        "fine-tuning, distillation). `dpo`: Direct Preference Optimization on `data.format: preference` pairs, "
        "against a frozen reference (`preference.reference`). `orpo`: ORPO on the same pairs: the chosen answer's "
        "cross-entropy plus an odds-ratio term, with no reference model. With `dpo`/`orpo` an example is a pair: "
        "`micro_batch_size` counts pairs (with the packed sampler, rows of up to 2 x `data.max_length` tokens, each "
        "holding as many whole pairs as fit) and the loss is normalized by pairs (docs/preference.md)."
    )
    micro_batch_size: int = Field(1, ge=1, description="Examples per forward/backward pass.")
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step. The loss is normalized by the number of target "
        "tokens in the whole accumulation window, so batch 4 x accum 1 equals batch 1 x accum 4."
    )
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many optimizer steps (takes precedence over `epochs`).", **RESUME_SAFE
    )
    epochs: float | None = Field(
        None, gt=0, description="Passes over the training data (fractions allowed). Default 1 when "
        "`max_steps` is unset.", **RESUME_SAFE
    )
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW).")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")

    @field_validator("adam_betas")
    @classmethod
    def _check_betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in value):
            raise ValueError("each beta must be in [0, 1), e.g. [0.9, 0.999]")
        return value
    optimizer: Literal[OPTIMIZER_NAMES] = Field("adamw", description=optimizers_doc())  # gpupoor.optimizers
    momentum: float = Field(0.9, ge=0, lt=1, description="Momentum of `optimizer: sgd`.")
    max_consecutive_skips: int = Field(
        10, ge=1, description="Steps with a non-finite loss or gradient norm are skipped and counted; after this "
        "many in a row the run stops with an error, keeping its last good checkpoint.", **RESUME_SAFE
    )
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup: cosine or linear to zero, or constant."
    )
    warmup_steps: int | None = Field(None, ge=0, description="Linear warmup steps (overrides `warmup_ratio`).")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Warmup as a fraction of the total steps.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the gradient norm to this; unset to skip.")
    eval_every_steps: int | None = Field(
        None, ge=1, description="Evaluate every N optimizer steps (and at the end) when eval data is set.", **RESUME_SAFE
    )
    early_stopping_patience: int | None = Field(
        None, ge=1, description="Stop when eval_loss has not improved by `early_stopping_min_delta` for this many "
        "evaluations in a row: final/ is written and the exit code is 0. Needs eval data and `eval_every_steps`.",
        **RESUME_SAFE
    )
    early_stopping_min_delta: float = Field(
        0.0, ge=0, description="The least fall of eval_loss that counts as an improvement.", **RESUME_SAFE
    )
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="`auto`: CUDA when available, else CPU.", **RESUME_SAFE)
    cpu_threads: int | None = Field(
        None, ge=1, description="torch threads on CPU. Default: the cores this process may use, divided among the "
        "processes a launcher started on this node.", **RESUME_SAFE
    )


class MemorySection(_Section):
    """Trade compute for memory."""

    @field_validator("max_gpu_memory")
    @classmethod
    def _check_memory(cls, value: str | None) -> str | None:
        # The parser the model loader and `plan` use, so a size that validates is one that loads.
        try:
            ok = value is None or parse_size(value, "memory.max_gpu_memory") >= MiB
        except UserError:
            ok = False
        if not ok:
            raise ValueError("use a size like 10GiB, 12GB or 8000MiB")
        return value

    gradient_checkpointing: bool | Literal["offload"] = Field(
        False, description="`true`: recompute each decoder layer's activations in backward (non-reentrant; "
        "LoRA gradients are bitwise those without it). `offload`: also keep each checkpointed layer input in "
        "pinned CPU memory until backward (long contexts on a small GPU; on a CPU it is the same as `true`).", **RESUME_SAFE
    )
    max_gpu_memory: str | None = Field(
        None, description="On a GPU, load at most this much of the base model's weights onto it (e.g. "
        "`10GiB`); the rest stays in CPU memory and is streamed in by accelerate's device map (slower, but it "
        "runs). Ignored on a CPU."
    )
    fused_cross_entropy: bool = Field(
        True, description="Compute the output head and the loss together, chunk by chunk over the target "
        "tokens only, with the gradient in the same pass: the full logits never exist. Falls back to the plain "
        "loss (and says why) for models that post-process logits or adapt the output head with LoRA."
    )


class CheckpointSection(_Section):
    """When to save progress. With neither `every_steps` nor `every_minutes` set, a checkpoint is written at
    least every 30 minutes of training, so a user who sets nothing loses at most half an hour."""

    every_steps: int | None = Field(
        None, ge=1, description="Save a checkpoint every N optimizer steps into `checkpoints/step-NNNNNN/`."
    )
    every_minutes: float | None = Field(
        None, gt=0, description="Save a checkpoint when this many minutes have passed since the last one "
        "(checked at optimizer step boundaries). Combines with `every_steps`."
    )
    keep_last: int = Field(
        2, ge=1, description="Valid checkpoints kept; older ones are removed after each new one is committed."
    )
    keep_best: bool = Field(
        False, description="Also keep the checkpoint with the lowest eval_loss: an eval that improves on the best "
        "saves a checkpoint of its step (when none was due), and `keep_last` never removes it. Needs eval data."
    )
    final: Literal["last", "best"] = Field(
        "last", description="What final/ holds: the weights of the last step, or (`best`, with `keep_best`) those "
        "of the best checkpoint by eval_loss."
    )
    time_limit: str | None = Field(
        None, description="Wall-clock budget of the run, e.g. `11h30m`, `45m`, `90s`. gpupoor saves a "
        "checkpoint and stops (exit 75) before it runs out, keeping one step's time in reserve."
    )

    @field_validator("time_limit", mode="before")
    @classmethod
    def _check_time_limit(cls, value):
        if isinstance(value, bool):
            raise ValueError("not a duration; use e.g. 11h30m, 45m or 90s")
        if isinstance(value, (int, float)):  # YAML reads `3600` (and `1:30:00`) as numbers: seconds
            value = str(value)
        if value is not None:
            seconds = parse_duration(value)
            if not math.isfinite(seconds) or seconds <= 0:
                raise ValueError("a time limit must be a positive duration, e.g. 11h30m")
        return value

    @property
    def time_limit_s(self) -> float | None:
        return None if self.time_limit is None else parse_duration(self.time_limit)

    @property
    def interval_minutes(self) -> float | None:
        """The time-based cadence in force: the recipe's, or the 30-minute default when nothing is set."""
        if self.every_minutes is None and self.every_steps is None:
            return DEFAULT_CHECKPOINT_MINUTES
        return self.every_minutes


class DistributedSection(_Section):
    """How several processes share the work. One process ignores this section; the launcher (torchrun or
    `accelerate launch`) says how many there are and on how many nodes."""

    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        "auto", description="`ddp`: every process holds the whole model and the gradients are averaged "
        "(fastest while the model fits one device). `fsdp`: PyTorch FSDP2 (`fully_shard`, like ZeRO-3) shards "
        "weights, gradients and optimizer state across the processes, so each holds about 1/N of them plus one "
        "layer gathered at a time. `auto`: ddp."
    )
    shard_frozen: bool = Field(
        True, description="fsdp: shard the frozen base weights too (the memory saving for LoRA). `false` keeps "
        "them whole on every process and shards only what trains. bitsandbytes-quantized base weights are "
        "always kept whole: FSDP cannot shard their packed storage."
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp: free each layer's gathered weights after its forward and gather them again in "
        "backward (ZeRO-3; least memory). `false` keeps them until backward (like ZeRO-2; less communication)."
    )
    cpu_offload: bool = Field(
        False, description="fsdp on GPUs: keep the sharded weights, gradients and optimizer state in CPU memory "
        "and step the optimizer there (a model that fits no GPU set, at the cost of speed). No effect on a CPU."
    )


class LoggingSection(_Section):
    """What gpupoor prints while training and which trackers get the metrics (metrics.jsonl always gets every
    step)."""

    every_steps: int = Field(1, ge=1, description="Print a plain log line every N optimizer steps (non-TTY).")
    progress: Literal["auto", "bar", "plain", "none"] = Field(
        "auto", description="`auto`: a progress bar on a terminal, plain log lines otherwise."
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Trackers that get every metrics record (loss, lr, grad norm, tokens/s, "
        "memory, eval loss and accuracy, checkpoint times, skipped steps) and the recipe as the run's config. Each "
        "is an extra: `pip install 'gpupoor[tensorboard]'` (or `[wandb]`, `[mlflow]`). TensorBoard writes into "
        "RUN_DIR/tensorboard; MLflow uses MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns; W&B follows "
        "its own login and WANDB_MODE. A tracker that fails warns once; training goes on."
    )
    project: str = Field("gpupoor", description="The W&B project / MLflow experiment the run is logged under.")
    run_name: str | None = Field(None, description="The tracker run's name. Default: the run directory's name.")
    offline: bool = Field(
        False, description="Trackers write only local files: W&B in offline mode (RUN_DIR/wandb; `wandb sync` "
        "uploads it later), MLflow to RUN_DIR/mlruns even when MLFLOW_TRACKING_URI is set."
    )

    profile_steps: int | None = Field(
        None, ge=1, description="Profile this many optimizer steps with torch.profiler after 2 warm-up steps "
        "(`train --profile N`): a Chrome/Perfetto trace, the top operators and where the step time goes "
        "(data, forward, loss, backward, optimizer) in RUN_DIR/profile/; on CUDA also a memory snapshot."
    )

    @field_validator("report_to")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        twice = sorted({name for name in value if value.count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once; name each tracker once")
        return value


class Recipe(_Section):
    """A gpupoor training recipe."""

    @model_validator(mode="after")
    def _evaluation_that_decides(self) -> "Recipe":
        data, training, checkpoint = self.data, self.training, self.checkpoint
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
        return self

    @model_validator(mode="after")
    def _preference_combinations(self) -> "Recipe":
        """Pairs and the preference objectives go together; what they cannot be combined with."""
        data, training, preference = self.data, self.training, self.preference
        objective = training.objective
        formats = {source.format for source in data.sources()}
        if objective == "sft" and "preference" in formats:
            raise ValueError("data.format preference holds pairs for a preference objective, and training.objective "
                             "is sft: set training.objective: dpo (or orpo), or use a format of single answers")
        if objective == "sft":
            return self
        if data.tokenized_path:
            raise ValueError(f"training.objective {objective} cannot read data.tokenized_path yet: give the pairs "
                             "as data.path (or data.datasets) with format: preference (they are cached tokenized)")
        if formats != {"preference"}:
            where = "data.datasets[].format" if data.datasets else "data.format"
            raise ValueError(f"training.objective {objective} trains on preference pairs: set {where}: preference "
                             f"(prompt, chosen, rejected), not {', '.join(sorted(formats - {'preference'}))}")
        if self.distill is not None:
            raise ValueError(f"training.objective {objective} and distill are two different losses: remove the "
                             "distill section, or train with objective sft")
        if data.train_on_prompt:
            raise ValueError(f"data.train_on_prompt does not apply to a preference objective ({objective}): it compares "
                             "the answers' log-probabilities, and the prompt is never trained. Remove it")
        self._check_reference(objective, preference)
        return self

    def _check_reference(self, objective: str, preference: "PreferenceSection") -> None:
        full = self.peft.method == "full"
        if objective == "orpo" or preference.reference == "copy":
            pass
        elif preference.reference == "adapter_off" and full:
            raise ValueError("preference.reference adapter_off needs an adapter to switch off, and peft.method full "
                             "trains the model's own weights: use reference copy (or auto)")
        elif preference.reference == "auto" and not full and self.peft.init_adapter:
            raise ValueError("preference.reference auto would switch the adapter off, leaving the base model "
                             "without peft.init_adapter as DPO's reference, not the model you start from: merge that "
                             "adapter into the base first (gpupoor merge-lora) and train a new one on the merged "
                             "model, or set preference.reference: adapter_off (or copy) to accept the base as "
                             "the reference")
        if objective == "dpo" and preference.label_smoothing and preference.loss_type != "sigmoid":
            raise ValueError(f"preference.label_smoothing applies to preference.loss_type sigmoid (conservative "
                             f"DPO); {preference.loss_type} has no smoothed form: remove label_smoothing, or use "
                             "loss_type sigmoid")
        using_copy = objective == "dpo" and (preference.reference == "copy" or (preference.reference == "auto"
                                                                                 and full))
        if preference.reference_bits is not None and not using_copy:
            raise ValueError("preference.reference_bits quantizes a reference copy, and this recipe has none "
                             + ("(ORPO needs no reference)" if objective == "orpo" else
                                "(the reference is the model with its adapter switched off)")
                             + ": remove it, or set preference.reference: copy")

    model: ModelSection
    data: DataSection
    peft: PeftSection = Field(default_factory=PeftSection)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    distill: DistillSection | None = Field(None, description="Knowledge distillation from a teacher (see the "
                                           "`distill` section); unset to train on the data alone.")
    preference: PreferenceSection = Field(default_factory=PreferenceSection)

    @field_validator("quantization")
    @classmethod
    def _no_quantized_full_tuning(cls, value: QuantizationSection, info) -> QuantizationSection:
        peft = info.data.get("peft")
        if peft is not None and peft.method == "full" and value.bits is not None:
            raise ValueError("a quantized base cannot be fully fine-tuned (peft.method: full): bitsandbytes weights "
                             "do not train. Use lora, dora or ia3 on a quantized base (QLoRA), or unset "
                             "quantization.bits")
        return value
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="`auto`: bf16 on GPUs with compute capability >= 8, fp16 + GradScaler on older "
        "GPUs, fp32 on CPU. An explicit bf16 on hardware without it is an error."
    )
    training: TrainingSection = Field(default_factory=TrainingSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    @field_validator("distributed")
    @classmethod
    def _fsdp_combinations(cls, value: DistributedSection, info) -> DistributedSection:
        if value.strategy != "fsdp":
            return value
        training, memory = info.data.get("training"), info.data.get("memory")
        if training is not None and training.optimizer not in FSDP_OPTIMIZERS:
            raise ValueError(f"distributed.strategy fsdp cannot step training.optimizer {training.optimizer}: its "
                             "update kernels do not run on FSDP2's sharded (DTensor) parameters. Use optimizer "
                             f"{' or '.join(FSDP_OPTIMIZERS)} with fsdp (sharding already splits the optimizer "
                             "state), or strategy ddp with the 8-bit or factored optimizer")
        if memory is not None and memory.max_gpu_memory is not None:
            raise ValueError("distributed.strategy fsdp and memory.max_gpu_memory both place the weights: FSDP "
                             "shards them across processes and cannot also stream them from CPU. Unset "
                             "memory.max_gpu_memory (fsdp's cpu_offload keeps shards in CPU memory instead)")
        return value

    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, **RESUME_SAFE)
    logging: LoggingSection = Field(default_factory=LoggingSection, **RESUME_SAFE)
    seed: int = Field(42, ge=0, le=2**64 - 1, description="Seeds weights init of adapters, data order and dropout.")
    output_dir: str | None = Field(
        None, description="Run directory. Relative paths resolve against the recipe file; default "
        "`runs/<recipe name>` in the current directory. Must be empty or absent.", **RESUME_SAFE
    )


DEFAULT_CHECKPOINT_MINUTES = 30.0


def recipe_json_schema() -> dict:
    """The JSON schema of a recipe file: the Recipe model plus `extends`, which loading resolves (a base
    recipe whose keys this file's keys are merged over)."""
    schema = Recipe.model_json_schema()
    schema["properties"] = {"extends": {"type": "string", "title": "Extends", "description": "A base recipe (path "
                                        "relative to this file) whose keys this file's keys are deep-merged over."},
                            **schema["properties"]}
    return schema

# ----------------------------------------------------------------------------------------------------------
# Loading: YAML with line numbers, --set overrides, and errors that say where.


class LoadedRecipe:
    """A validated recipe plus where it came from (for relative paths and error messages) and the dotted keys
    `--set` gave (plan --fit writes them beside its own changes)."""

    def __init__(self, recipe: Recipe, source: Path | None, overridden: tuple[str, ...] = ()):
        self.recipe = recipe
        self.source = source
        self.overridden = overridden

    @property
    def base_dir(self) -> Path:
        return self.source.parent if self.source else Path.cwd()


def _line_map(text: str, source: str) -> dict[str, str]:
    """Dotted key -> `source:line` of that key in the YAML text (1-based line). A location names its file because
    a recipe that `extends` another holds keys of both."""
    lines: dict[str, str] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                lines[key] = f"{source}:{key_node.start_mark.line + 1}"
                walk(value_node, key)

    try:
        root = yaml.compose(text, Loader=_RecipeLoader)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, "")
    return lines


MAX_YAML_VALUES = 10_000  # values in a recipe with every alias expanded; real recipes have a few hundred


class _RefusedYAML(yaml.composer.ComposerError):
    """YAML that parses but that a recipe refuses (alias bombs); reported without "not valid YAML"."""


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and alias bombs.

    An alias (`*name`) reuses its anchor's node, so nested aliases ("billion laughs") build a document of
    billions of values from a few hundred bytes; validating or printing it then runs out of memory. Count the
    values the document has with every alias expanded, and refuse past MAX_YAML_VALUES at the alias that
    crosses the limit. Small reuse (`lr: &lr 1e-4` ... `*lr`) still works."""

    def __init__(self, stream):
        super().__init__(stream)
        self._expanded_values = 0
        self._done: set[int] = set()  # ids of nodes fully composed
        self._sizes: dict[int, int] = {}  # id(node) -> values in it, aliases expanded

    def compose_node(self, parent, index):
        if not self.check_event(yaml.AliasEvent):
            self._expanded_values += 1  # its children are counted as they are composed
            node = super().compose_node(parent, index)
            self._done.add(id(node))
            return node
        event = self.peek_event()
        node = super().compose_node(parent, index)
        if id(node) not in self._done:  # `&a [*a]`: the alias is inside its own anchor
            raise _RefusedYAML(None, None, f"alias *{event.anchor} is inside its own anchor "
                                              f"&{event.anchor} (a recursive document)", event.start_mark)
        self._expanded_values += self._size(node)
        if self._expanded_values > MAX_YAML_VALUES:
            raise _RefusedYAML(
                None, None, f"alias *{event.anchor} expands the recipe past {MAX_YAML_VALUES} values (aliases "
                "of aliases, a \"billion laughs\" document); a recipe is small: write its values out, or use "
                "aliases only for a few small values", event.start_mark)
        return node

    def _size(self, node: yaml.Node) -> int:
        if id(node) not in self._sizes:
            size = 1
            if isinstance(node, yaml.SequenceNode):
                size += sum(self._size(child) for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                size += sum(self._size(key) + self._size(value) for key, value in node.value)
            self._sizes[id(node)] = min(size, MAX_YAML_VALUES + 1)  # past the limit the exact count is moot
        return self._sizes[id(node)]


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key]})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def apply_overrides(data: dict, overrides: list[str]) -> list[str]:
    """Apply `KEY.PATH=VALUE` overrides in place (values parsed as YAML scalars). Returns the dotted keys."""
    keys = []
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set training.max_steps=100")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = yaml.load(raw, Loader=_RecipeLoader) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise UserError(f"--set {key}: cannot parse value {_short(raw)} as YAML: {exc}") from None
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"--set {key}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
        keys.append(key)
    return keys


def _allowed_keys(loc: tuple) -> list[str]:
    """Field names allowed at the parent of an error location."""
    model: type[BaseModel] | None = Recipe
    for part in loc[:-1]:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        model = section_model(model.model_fields[part].annotation)
    return list(model.model_fields) if model else []


def section_model(annotation) -> type[BaseModel] | None:
    """The section a field holds: `Section`, or `Section | None` for an optional one; None for a value."""
    import typing

    return next((c for c in (annotation, *typing.get_args(annotation))
                 if isinstance(c, type) and issubclass(c, BaseModel)), None)


MAX_REPORTED_ERRORS = 10
MAX_VALUE_CHARS = 200


def _short(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """repr(value), cut to `limit` characters: a huge value must not make a huge error message."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_validation_error(exc: ValidationError, source: str, lines: dict[str, str],
                            overridden: set[str]) -> str:
    messages = []
    errors = exc.errors()
    for err in errors[:MAX_REPORTED_ERRORS]:
        where = _where(".".join(str(p) for p in err["loc"]), source, lines, overridden)
        loc = tuple(str(p) if len(str(p)) <= MAX_VALUE_CHARS else str(p)[: MAX_VALUE_CHARS - 3] + "..."
                    for p in err["loc"])  # a huge unknown key must not make a huge message
        dotted = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc)
            guess = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            msg = f"{where}: unknown key '{dotted}'"
            if guess:
                parent = ".".join(str(p) for p in loc[:-1])
                msg += f"; did you mean '{parent + '.' if parent else ''}{guess[0]}'?"
            msg += f"\n    allowed here: {', '.join(allowed)}"
        elif err["type"] == "missing":
            msg = f"{where}: '{dotted}' is required"
        else:
            detail = err["msg"].removeprefix("Value error, ")
            named = _named_key(detail) if len(loc) <= 1 else None
            if named:  # a rule across sections names the key it is about: point there, not at the whole section
                msg = f"{_where(named, source, lines, overridden)}: {detail}"
            else:
                msg = f"{where}: '{dotted}' = {_short(err.get('input'))}: {detail}"
        messages.append(msg)
    if len(errors) > MAX_REPORTED_ERRORS:
        messages.append(f"... and {len(errors) - MAX_REPORTED_ERRORS} more errors")
    return "invalid recipe:\n  " + "\n  ".join(messages) + \
        "\n  see docs/recipe.md or `gpupoor schema` for every key"


def _named_key(detail: str) -> str | None:
    """The dotted recipe key a message starts with (`training.early_stopping_patience needs ...`), if any."""
    first = detail.split(" ", 1)[0]
    return first if "." in first and first.split(".", 1)[0] in Recipe.model_fields else None


def _where(dotted: str, source: str, lines: dict[str, str], overridden: set[str]) -> str:
    parts = dotted.split(".")
    for depth in range(len(parts), 0, -1):  # the override itself, or one that set a whole section
        if ".".join(parts[:depth]) in overridden:
            return f"--set {'.'.join(parts[:depth])}"
    key = dotted
    while key and key not in lines:  # point at the nearest enclosing key that is in the file
        key = key.rpartition(".")[0]
    return lines[key] if key else source


EXTENDS = "extends"  # the one top-level key that is not the schema's: the base recipe this one starts from


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> LoadedRecipe:
    """Read a recipe (its `extends:` bases merged under it), apply `--set` overrides, validate. Raises UserError
    with file:line on any problem, naming the file (base or child) that wrote the key."""
    path = Path(path)
    if not path.is_file():
        if path.exists():  # a directory, a FIFO, a device: reading it would fail or block
            raise UserError(f"{path}: not a regular file", hint="pass the path of a .yaml recipe file")
        raise UserError(f"recipe not found: {path}", hint="pass the path of a .yaml recipe, e.g. recipes/demo.yaml")
    data, lines = _load_tree(path, ())
    overridden = apply_overrides(data, overrides or [])
    recipe = validate_recipe_data(data, str(path), lines, set(overridden))
    return LoadedRecipe(recipe, path.resolve(), tuple(overridden))


def _load_tree(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
    """The mapping in `path` with its `extends:` chain merged under it, and the file:line of every dotted key.
    `chain`: the files that extend this one, outermost first (a base among them is a cycle)."""
    data, lines = _read_mapping(path)
    if EXTENDS not in data:
        return data, lines
    name, where = data.pop(EXTENDS), lines.pop(EXTENDS, str(path))
    base = _base_path(name, path, where, chain)
    base_data, base_lines = _load_tree(base, (*chain, path))
    merged = _deep_merge(base_data, data)
    # A key the child replaced with a scalar or list takes the base's keys below it away with it.
    kept = {key: place for key, place in base_lines.items() if _has_key(merged, key)}
    return merged, {**kept, **lines}


def _read_mapping(path: Path) -> tuple[dict, dict[str, str]]:
    try:
        text = decode_utf8(path, path.read_bytes())
    except OSError as exc:
        raise UserError(f"{path}: cannot read the recipe: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_RecipeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        if isinstance(exc, _RefusedYAML):
            raise UserError(f"{where}: {problem}") from None
        raise UserError(f"{where}: not valid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}:1: a recipe is a mapping of sections ({', '.join(Recipe.model_fields)})")
    return data, _line_map(text, str(path))


def _base_path(name: Any, child: Path, where: str, chain: tuple[Path, ...]) -> Path:
    """The file `extends: name` in `child` names (relative to the child's folder), checked before it is read."""
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{where}: extends: {_short(name)}: give the path of a base recipe, relative to this file",
                        hint="e.g. extends: base.yaml")
    base = child.parent / Path(name).expanduser()
    if not base.is_file():
        problem = "not a regular file" if base.exists() else "no such file"
        raise UserError(f"{where}: extends: {name}: {problem} ({base.resolve()})",
                        hint=f"the path is relative to the folder of {child}: fix it, or remove the extends line")
    files = (*chain, child)
    if any(base.resolve() == earlier.resolve() for earlier in files):
        cycle = " -> ".join(str(f) for f in files[[f.resolve() for f in files].index(base.resolve()):]) + f" -> {base}"
        raise UserError(f"{where}: extends: {name} makes a cycle: {cycle}",
                        hint="a base recipe must not extend (directly or through others) a recipe that extends it")
    return base


def _deep_merge(base: dict, child: dict) -> dict:
    """`child` over `base`: mappings merged key by key; lists, scalars and nulls replace what the base had."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _has_key(tree: dict, dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def validate_recipe_data(data: dict, source: str = "<recipe>", lines: dict[str, str] | None = None,
                         overridden: set[str] | None = None) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc, source, lines or {}, overridden or set())) from None


def decode_utf8(path: Path | str, raw: bytes) -> str:
    """The text of a file's bytes, or a UserError naming the file, line and byte offset of the first byte that is
    not UTF-8 (the recipe and data files are read as UTF-8)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at byte offset {exc.start} "
                        f"(line {line}, column {column}): {exc.reason}",
                        hint="save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`, or your editor's "
                        "\"save with encoding\")") from None


def recipe_to_yaml(recipe: Recipe, header: str = "") -> str:
    body = yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
    return header + body


DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def resolve_local_path(value: str, base_dir: Path, file_suffixes: tuple[str, ...] = ()) -> Path | None:
    """The local path a recipe value names, or None when it names a hub id (`owner/name`).

    A value is local when it exists relative to the recipe, starts like a path (., /, ~) or ends in one of
    `file_suffixes`; a hub id never does (`Qwen/Qwen2.5-1.5B` has a dot but no data suffix).
    """
    expanded = Path(value).expanduser()
    candidate = expanded if expanded.is_absolute() else base_dir / expanded
    if candidate.exists() or value.startswith((".", "/", "~")) or value.lower().endswith(file_suffixes):
        return candidate.resolve()
    return None

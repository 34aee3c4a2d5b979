"""The recipe's schema: its sections and keys, each documented here, once (`gpupoor schema` and docs/recipe.md
are generated from these descriptions), with the checks of a single key. The rules across keys are
gpupoor.recipe.rules (each section calls them once validated); reading a recipe file is gpupoor.recipe.loading.
Facts about a key are marked on its field (RESUME_SAFE, ADDED). Imports no torch: `validate` and `--help` stay fast.
It is longer than 600 lines because every key's documentation lives on its field, by design: one place, generated.
"""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpupoor.errors import UserError
from gpupoor.recipe.rules import MAX_PASSES, check_data, check_model, check_peft, check_recipe, check_source
from gpupoor.method_table import METHOD_NAMES, METHODS
from gpupoor.objective_table import OBJECTIVE_NAMES, OBJECTIVES, PAIRS_NOTE
from gpupoor.optimizers import OPTIMIZER_NAMES, optimizers_doc
from gpupoor.scorers import check_scorer_name
from gpupoor.units import MiB, parse_duration, parse_size


# Marks a key a resume may change (how long to train, when to save, what to print, where to evaluate; a section:
# on its field in Recipe). Any other key changes the trajectory: refused on resume unless --force.
RESUME_SAFE: dict = {"json_schema_extra": {"resume": "safe"}}

# Marks a key added after runs were written, with the value that means "as before" (what older recipes had, in
# effect): gpupoor.recipe.diff hashes the key only when it holds another, so an older checkpoint still matches its
# run's recipe (a dict value stands for each flattened key). Other keys are tests/test_recipe.py's ORIGINAL_KEYS.
ADDED_MARK = "added"


def ADDED(as_before: object) -> dict:
    return {"json_schema_extra": {ADDED_MARK: as_before}}


def is_resume_safe(field) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("resume") == "safe"


def is_added(field) -> bool:
    """Marked ADDED: its value that means "as before" is `field.json_schema_extra[ADDED_MARK]`."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and ADDED_MARK in extra


class _Section(BaseModel):
    # allow_inf_nan=False: `.inf` / `.nan` in YAML is a schema error on every float key, not a NaN loss later.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelSection(_Section):
    """Which base model to fine-tune and how to load it."""

    name_or_path: str = Field(
        description="Hugging Face hub id (e.g. `Qwen/Qwen2.5-1.5B`), a local directory saved with "
        "`save_pretrained`, or a local `.gguf` file (as llama.cpp, Ollama and LM Studio run it: dequantized to the "
        "training dtype, with the tokenizer and chat template it carries; needs `pip install gguf`). Relative paths "
        "resolve against the recipe file."
    )
    gguf_file: str | None = Field(
        None, description="A GGUF file inside the directory `name_or_path` names (the same as naming the file "
        "itself in `name_or_path`).", **ADDED(None))
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) to load.")
    trust_remote_code: bool = Field(
        False, description="Run model code shipped in the model repository. Off unless you trust it."
    )
    attention: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto",
        description="Attention backend. `auto` picks flash_attention_2 when flash-attn imports and the GPU "
        "supports it (compute capability >= 8), else sdpa. The startup summary says what was chosen and why.",
    )
    fused_layers: bool = Field(True, description="On llama, qwen2, mistral and gemma: LoRA linears and the gated MLP "
        "as single autograd functions (the MLP keeps 2 intermediate-wide tensors per token fewer and recomputes its "
        "activation), in fp32 or bf16; on a CPU also sdpa attention per packed example (cost sum of len^2, not "
        "max_length^2; on a GPU one masked call is faster) and masked sdpa with each key/value head shared by its "
        "query heads, not copied to each (padded rows, GRPO's answers: 3x fewer kept keys and values on SmolLM2). "
        "Losses and gradients equal the plain modules' to "
        "rounding. Other families, DoRA, IA3, `full`, dropout > 0, quantized or fp16 bases run the plain modules "
        "(the startup summary says which). `false`: plain everywhere.",
        **ADDED(False))
    kernels: Literal["none", "liger"] = Field("none", description="`liger`: Liger-Kernel's Triton RMSNorm, RoPE and "
        "SwiGLU in place of transformers' modules on llama, qwen2, qwen3, mistral and gemma, on CUDA only (`pip "
        "install 'gpupoor[liger]'`); the loss stays gpupoor's fused one. Elsewhere the summary says it is off.",
        **ADDED("none"))
    compile: bool = Field(False, description="torch.compile each decoder layer. The first steps pay the compile "
        "time (tens of seconds; metrics.jsonl's first step shows it). Experimental: slower on the CPUs measured "
        "(varying packed shapes recompile; docs/benchmarks.md, torch.compile), not yet measured on a GPU.",
        **ADDED(False))

    @model_validator(mode="after")
    def _rules(self) -> "ModelSection":
        check_model(self)
        return self


# The data formats' names: gpupoor.data.row_formats.FORMATS has one class per name (the schema comes before data/, so
# the two lists are tied by tests/unit/data/test_formats.py, not by an import). The Literal is this tuple.
# The keys naming a row's fields: set on `data`, or per source (unset there: `data`'s). gpupoor.data.row_formats.FieldNames
# holds one attribute per key, under the same name, so a new field name is one key here, its two Fields, and its use.
FIELD_KEYS = ("text_field", "messages_field", "conversations_field")
DATA_FORMATS = ("text", "alpaca", "chat", "sharegpt", "completion", "tokenized", "preference")
DataFormat = Literal[DATA_FORMATS]
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}


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
    def _rules(self) -> "SourceSection":
        check_source(self)
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
        "run resumes in the middle of it exactly.", **ADDED(None)
    )
    tokenized_path: str | None = Field(
        None, description="A directory `gpupoor tokenize` wrote: the training (and eval) data already tokenized, "
        "memory-mapped, for reuse by many runs or nodes.", **ADDED(None)
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
    conversations_field: str = Field("conversations", description="Field holding the turns for `format: sharegpt`.",
                                     **ADDED("conversations"))
    sharegpt_roles: dict[str, Literal["system", "user", "assistant", "tool"]] = Field(
        default_factory=lambda: dict(SHAREGPT_ROLES),
        description="ShareGPT `from` values and the chat role each one is.", **ADDED(SHAREGPT_ROLES)
    )
    chat_template: str | None = Field(
        None, description="For `chat` and `sharegpt`: a template name (`llama3`, `chatml`, `gemma`, `mistral`, "
        "`phi3`, `qwen2.5`, `smollm2`, `deepseek`, `llama2`, `vicuna`, `alpaca-chat`) or a Jinja template. Default: "
        "the tokenizer's own; a tokenizer without one needs this set."
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
        inherited = ("format", "split", *FIELD_KEYS)
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
    def _rules(self) -> "DataSection":
        check_data(self)
        return self


class PeftSection(_Section):
    """What trains: adapters on the frozen base model (LoRA, DoRA, IA3), or the model's own weights (full), on
    every decoder layer or only the last few."""

    method: Literal[METHOD_NAMES] = Field(  # the method table, gpupoor/method_table.py
        "lora", description=" ".join(f"`{m.name}`: {m.doc}" for m in METHODS.values())
    )
    last_layers: int | None = Field(
        None, ge=1, description="Adapt (with `full`: train) only the last N decoder layers. The layers below stay "
        "frozen and keep no activations for backward, so memory and time fall with N.", **ADDED(None)
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
        "QLoRA included; the stored recipe keeps the path.", **ADDED(None)
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
    def _rules(self) -> "PeftSection":
        check_peft(self)
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
        "1 / (2 beta)).", **ADDED(0.1)
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="DPO's loss of the reward margin m: `sigmoid` -log sigmoid(beta m) (the paper's), "
        "`ipo` (m per answer token - 1 / (2 beta))^2, `hinge` relu(1 - beta m) (SLiC).", **ADDED("sigmoid")
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="`sigmoid` only: the share of pairs assumed to be mislabelled (conservative "
        "DPO): -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m).", **ADDED(0.0)
    )
    orpo_lambda: float = Field(
        0.1, gt=0, description="ORPO's lambda (TRL's ORPOConfig.beta): the weight of the odds-ratio term beside the "
        "chosen answer's cross-entropy.", **ADDED(0.1)
    )
    reference: Literal["auto", "adapter_off", "copy"] = Field(
        "auto", description="DPO's frozen reference model. `adapter_off`: the model being trained with its adapter "
        "switched off (peft's disable_adapter), in the same micro-batch: no second copy in memory. `copy`: a "
        "frozen copy of the base model loaded beside it (quantizable with `reference_bits`). `auto`: "
        "`adapter_off` when an adapter trains, `copy` for `peft.method: full`.", **ADDED("auto")
    )
    reference_bits: Literal[4, 8] | None = Field(
        None, description="Load the reference copy quantized (bitsandbytes) to fit beside the trained model; "
        "`reference: copy` (or `full` with `auto`) only. Its log-probabilities shift a little. With the bits of "
        "`quantization.bits` it takes that section's settings (quant_type, double_quant, compute_dtype): the very "
        "base the policy trains on; other bits use nf4 with double quantization.", **ADDED(None)
    )


class RewardSection(_Section):
    """One of GRPO's rewards: a scorer and its weight in the sum."""

    scorer: str = Field(
        description="exact (the answer equals the row's expected answer, spaces trimmed), contains (holds it), json "
        "(parses as JSON), regex:PATTERN (matches anywhere), length<=N (1 up to N characters, falling to 0 at "
        "2N), or module:function: your function(answer, expected, row) returning a finite number (row: the "
        "prompt and expected answer as text, docs/grpo.md)."
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="Its weight in the answer's reward (the weighted "
                          "sum of the scores); at least one reward's weight is not 0.")

    @field_validator("scorer")
    @classmethod
    def _known(cls, value: str) -> str:
        try:
            check_scorer_name(value, "scorer")
        except UserError as exc:
            raise ValueError(f"{exc.message}; {exc.hint}" if exc.hint else exc.message) from None
        return value


class GrpoSection(_Section):
    """GRPO (`training.objective: grpo`): a group of answers sampled to each prompt, scored by the rewards, and the
    policy pushed toward the answers better than their group's mean (docs/grpo.md). Unused by other objectives."""

    group_size: int = Field(4, ge=2, description="Answers sampled to each prompt; `training.micro_batch_size` "
                            "counts prompts, so a micro-batch holds micro_batch_size x group_size answers.",
                            **ADDED(4))
    max_new_tokens: int = Field(64, ge=1, description="The longest answer sampled (tokens); one that has not ended "
                                "by then is cut there and scored as it is.", **ADDED(64))
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the answers.", **ADDED(1.0))
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens holding this "
                         "much probability; 1 samples from the whole vocabulary.", **ADDED(1.0))
    beta: float = Field(0.0, ge=0, description="Weight of the KL to the reference (the base: the adapter switched "
                        "off, no second copy). 0 (Dr. GRPO, DAPO; TRL's default) skips the reference's forward "
                        "altogether; GRPO's paper used 0.04.", **ADDED(0.0))
    epsilon: float = Field(0.2, gt=0, lt=1, description="The clip of the ratio pi / pi_old from below (1 - "
                           "epsilon) and, without epsilon_high, from above (1 + epsilon).", **ADDED(0.2))
    epsilon_high: float | None = Field(None, gt=0, description="The clip from above (DAPO's clip-higher, e.g. "
                                       "0.28); unset: epsilon.", **ADDED(None))
    iterations: int = Field(1, ge=1, description="Optimizer steps on each sampled batch (GRPO's mu): 1 samples "
                            "anew every step (the ratio is then 1 and nothing is clipped); N > 1 samples every Nth "
                            "step, and the N - 1 steps between reuse the answers, kept in the checkpoint.",
                            **ADDED(1))
    loss_normalization: Literal["sequence", "token", "constant"] = Field(
        "token", description="How answer tokens are averaged: `sequence` each answer's mean, then the mean over "
        "answers (GRPO as published); `token` the mean over all answer tokens of the micro-batch (DAPO, TRL's "
        "default): long answers weigh as much per token; `constant` the sum over answer x max_new_tokens (Dr. "
        "GRPO): no length bias at all.", **ADDED("token")
    )
    scale_rewards: bool = Field(True, description="Divide each answer's advantage by its group's standard "
                                "deviation (GRPO); false keeps the plain difference from the group's mean (Dr. "
                                "GRPO: every prompt weighs the same, easy or hard).", **ADDED(True))
    rewards: list[RewardSection] = Field(
        default_factory=lambda: [RewardSection(scorer="exact")], min_length=1,
        description="The rewards, summed with their weights into each answer's reward; each is also logged "
        "alone (reward_NAME).", **ADDED([{"scorer": "exact", "weight": 1.0}])
    )

    @field_validator("rewards")
    @classmethod
    def _each_scorer_once(cls, value: list[RewardSection]) -> list[RewardSection]:
        twice = sorted({r.scorer for r in value if [o.scorer for o in value].count(r.scorer) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once: give each scorer once, with its weight")
        if all(r.weight == 0 for r in value):  # every answer's reward 0, every advantage 0: nothing would train
            raise ValueError("every reward's weight is 0, so every answer's reward and advantage would be 0 and "
                             "training would change nothing: give at least one reward a weight other than 0")
        return value


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

    objective: Literal[OBJECTIVE_NAMES] = Field(  # the objective table, gpupoor/objective_table.py
        "sft", description="What the model learns. " + " ".join(f"`{o.name}`: {o.doc}" for o in OBJECTIVES.values())
        + " " + PAIRS_NOTE, **ADDED("sft")
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
        None, ge=1, description="torch threads on CPU. Default: the cores this process may use, less those other "
        "processes keep busy at start (measured over 0.2 s: a thread sharing a core stalls every step), divided "
        "among the processes a launcher started on this node. The startup summary says how many and why.",
        **RESUME_SAFE
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
        "layer gathered at a time. `auto`: ddp.", **ADDED("auto")
    )
    shard_frozen: bool = Field(
        True, description="fsdp: shard the frozen base weights too (the memory saving for LoRA). `false` keeps "
        "them whole on every process and shards only what trains. bitsandbytes-quantized base weights are "
        "always kept whole: FSDP cannot shard their packed storage.", **ADDED(True)
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp: free each layer's gathered weights after its forward and gather them again in "
        "backward (ZeRO-3; least memory). `false` keeps them until backward (like ZeRO-2; less communication).",
        **ADDED(True)
    )
    cpu_offload: bool = Field(
        False, description="fsdp on GPUs: keep the sharded weights, gradients and optimizer state in CPU memory "
        "and step the optimizer there (a model that fits no GPU set, at the cost of speed). No effect on a CPU.",
        **ADDED(False)
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
        "is an extra: `pip install -e '.[tensorboard]'` from gpupoor's clone (or `[wandb]`, `[mlflow]`). TensorBoard writes into "
        "RUN_DIR/tensorboard; MLflow uses MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns; W&B follows "
        "its own login and WANDB_MODE. A tracker that fails warns once; training goes on."
    )
    report: bool = Field(
        True, description="A finished run writes RUN_DIR/report.html (loss, eval loss, learning rate, tokens/s and "
        "memory over the steps, as `gpupoor report` draws them) by itself. Needs matplotlib (the `report` extra); "
        "without it, or with `false`, nothing is drawn.", **RESUME_SAFE
    )
    project: str = Field("gpupoor", description="The W&B project / MLflow experiment the run is logged under.")
    run_name: str | None = Field(None, description="The tracker run's name. Default: the run directory's name.")
    offline: bool = Field(
        False, description="Trackers write only local files: W&B in offline mode (RUN_DIR/wandb; `wandb sync` "
        "uploads it later), MLflow to RUN_DIR/mlruns even when MLFLOW_TRACKING_URI is set."
    )

    profile_steps: int | None = Field(
        None, ge=1, le=1000, description="Profile this many optimizer steps with torch.profiler after 2 warm-up "
        "steps (`train --profile N`): a Chrome/Perfetto trace, the top operators and where the step time goes "
        "(data, forward, loss, backward, optimizer) in RUN_DIR/profile/; on CUDA also a memory snapshot. At most "
        "1000: a trace grows with every step profiled, and a few steps say where the time goes."
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

    model: ModelSection
    data: DataSection
    peft: PeftSection = Field(default_factory=PeftSection)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    distill: DistillSection | None = Field(None, description="Knowledge distillation from a teacher (see the "
                                           "`distill` section); unset to train on the data alone.", **ADDED(None))
    preference: PreferenceSection = Field(default_factory=PreferenceSection)
    grpo: GrpoSection = Field(default_factory=GrpoSection)
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="`auto`: bf16 on GPUs with compute capability >= 8, fp16 + GradScaler on older "
        "GPUs; on a CPU bf16 where its flags name bf16 matrix units (`amx_bf16`, `avx512_bf16`, Arm `bf16`) and a "
        "matmul probe at start measures bf16 at least 1.5x faster than fp32, fp32 elsewhere ([cli.md: CPU "
        "precision](cli.md#cpu-precision-bf16-where-the-cpu-has-bf16-matrix-units)); a resume keeps the "
        "precision its checkpoint was written in. bf16 keeps the frozen base in bf16 and what trains in fp32 "
        "(master weights). An explicit bf16 on a GPU without it is an error; on a CPU without units it trains "
        "with a warning giving the measured slowdown. fp16 on a CPU is an error."
    )
    training: TrainingSection = Field(default_factory=TrainingSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, **RESUME_SAFE)
    logging: LoggingSection = Field(default_factory=LoggingSection, **RESUME_SAFE)
    seed: int = Field(42, ge=0, le=2**64 - 1, description="Seeds weights init of adapters, data order and dropout.")
    output_dir: str | None = Field(
        None, description="Run directory. Relative paths resolve against the recipe file; default "
        "`runs/<recipe name>` in the current directory. Must be empty or absent.", **RESUME_SAFE
    )

    @model_validator(mode="after")
    def _rules(self) -> "Recipe":
        check_recipe(self)  # after every section is validated: the rules read several of them
        return self


DEFAULT_CHECKPOINT_MINUTES = 30.0


def section_model(annotation) -> type[BaseModel] | None:
    """The section a field holds: `Section`, or `Section | None` for an optional one; None for a value."""
    return next((c for c in (annotation, *typing.get_args(annotation))
                 if isinstance(c, type) and issubclass(c, BaseModel)), None)


"""The keys people bring from LLaMA-Factory and axolotl recipes, and where each lives in a gpupoor recipe: the
unknown-key error names the gpupoor key (and how the value changes, where it does) instead of guessing by
spelling. docs/migration.md is the same table for reading. tests/unit/recipe/test_peer_keys.py checks that every
gpupoor key named here exists in the schema."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerKey:
    ours: str  # the dotted gpupoor key
    tools: str  # whose key it is
    note: str = ""  # how the value changes, when it does


LF = "LLaMA-Factory"
AX = "axolotl"
BOTH = "LLaMA-Factory and axolotl"

PEER_KEYS: dict[str, PeerKey] = {
    # the model
    "model_name_or_path": PeerKey("model.name_or_path", LF),
    "base_model": PeerKey("model.name_or_path", AX),
    "trust_remote_code": PeerKey("model.trust_remote_code", BOTH),
    "flash_attn": PeerKey("model.attention", LF, "flash_attention_2 or sdpa"),
    "flash_attention": PeerKey("model.attention", AX, "flash_attention_2 or sdpa"),
    # the data
    "dataset": PeerKey("data.path", LF, "a file or hub dataset; several sources go in data.datasets"),
    "datasets": PeerKey("data.datasets", AX, "a list of {path, format, weight...}"),
    "cutoff_len": PeerKey("data.max_length", LF),
    "sequence_len": PeerKey("data.max_length", AX),
    "max_seq_length": PeerKey("data.max_length", "TRL"),
    "template": PeerKey("data.chat_template", LF, "a named template (llama3, chatml, qwen2.5, ...) or Jinja text"),
    "chat_template": PeerKey("data.chat_template", AX),
    "packing": PeerKey("data.sampler", LF, "data.sampler: packed"),
    "sample_packing": PeerKey("data.sampler", AX, "data.sampler: packed"),
    "train_on_inputs": PeerKey("data.train_on_prompt", AX),
    "train_on_prompt": PeerKey("data.train_on_prompt", LF),
    "val_size": PeerKey("data.eval_rows", LF, "a number of rows, not a fraction"),
    "val_set_size": PeerKey("data.eval_rows", AX, "a number of rows, not a fraction"),
    "max_samples": PeerKey("data.max_rows", LF),
    # the training method
    "finetuning_type": PeerKey("peft.method", LF, "lora, dora, ia3 or full"),
    "adapter": PeerKey("peft.method", AX, "lora (and quantization.bits: 4 for qlora)"),
    "lora_rank": PeerKey("peft.rank", LF),
    "lora_r": PeerKey("peft.rank", AX),
    "lora_alpha": PeerKey("peft.alpha", BOTH),
    "lora_dropout": PeerKey("peft.dropout", BOTH),
    "lora_target": PeerKey("peft.target_modules", LF, "a list, or all-linear"),
    "lora_target_modules": PeerKey("peft.target_modules", AX, "a list, or all-linear"),
    "lora_target_linear": PeerKey("peft.target_modules", AX, "peft.target_modules: all-linear"),
    "use_dora": PeerKey("peft.method", LF, "peft.method: dora"),
    "quantization_bit": PeerKey("quantization.bits", LF),
    "load_in_4bit": PeerKey("quantization.bits", AX, "quantization.bits: 4"),
    "load_in_8bit": PeerKey("quantization.bits", AX, "quantization.bits: 8"),
    "stage": PeerKey("training.objective", LF, "sft, dpo or orpo"),
    "rl": PeerKey("training.objective", AX, "dpo or orpo"),
    # the loop
    "per_device_train_batch_size": PeerKey("training.micro_batch_size", LF),
    "micro_batch_size": PeerKey("training.micro_batch_size", AX),
    "gradient_accumulation_steps": PeerKey("training.gradient_accumulation_steps", BOTH),
    "learning_rate": PeerKey("training.learning_rate", BOTH),
    "num_train_epochs": PeerKey("training.epochs", LF),
    "num_epochs": PeerKey("training.epochs", AX),
    "max_steps": PeerKey("training.max_steps", BOTH),
    "lr_scheduler_type": PeerKey("training.lr_scheduler", LF),
    "lr_scheduler": PeerKey("training.lr_scheduler", AX),
    "warmup_ratio": PeerKey("training.warmup_ratio", BOTH),
    "warmup_steps": PeerKey("training.warmup_steps", BOTH),
    "weight_decay": PeerKey("training.weight_decay", BOTH),
    "max_grad_norm": PeerKey("training.max_grad_norm", BOTH),
    "optim": PeerKey("training.optimizer", LF),
    "optimizer": PeerKey("training.optimizer", AX),
    "eval_steps": PeerKey("training.eval_every_steps", BOTH),
    "early_stopping_patience": PeerKey("training.early_stopping_patience", AX),
    "bf16": PeerKey("precision", BOTH, "precision: bf16"),
    "fp16": PeerKey("precision", BOTH, "precision: fp16"),
    "gradient_checkpointing": PeerKey("memory.gradient_checkpointing", BOTH),
    # checkpoints and logging
    "save_steps": PeerKey("checkpoint.every_steps", BOTH),
    "save_total_limit": PeerKey("checkpoint.keep_last", BOTH),
    "logging_steps": PeerKey("logging.every_steps", BOTH),
    "report_to": PeerKey("logging.report_to", LF),
    "wandb_project": PeerKey("logging.project", AX, "with logging.report_to: [wandb]"),
    "run_name": PeerKey("logging.run_name", LF),
}


# Their keys gpupoor does not need: what they configure, gpupoor decides or does anyway (None: mapped by value in
# gpupoor/recipe/convert.py). The unknown-key error and convert-recipe say so instead of guessing a key.
NOT_NEEDED = {
    "do_train": "gpupoor train trains", "do_eval": "eval runs when there is eval data",
    "overwrite_output_dir": "a new run needs an empty directory; `--resume-if-present` continues one",
    "overwrite_cache": "the tokenized cache is keyed by the data, tokenizer and settings, so it never goes stale",
    "preprocessing_num_workers": "tokenization uses the machine's cores", "dataloader_num_workers": "batches come from memory-mapped token ids",
    "plot_loss": "report.html is drawn at the end (logging.report)",
    "ddp_timeout": "processes that wait on each other are timed by torch's defaults",
    "save_only_model": "checkpoints always hold what an exact resume needs",
    "resume_from_checkpoint": "gpupoor resume RUN_DIR", "per_device_eval_batch_size": "eval uses the micro batch",
    "eval_strategy": "eval runs every training.eval_every_steps (their eval_steps)", "quantization_method": "bitsandbytes is gpupoor's quantization",
    "stage": None, "bf16": None, "fp16": None,  # (mapped below, by value)
    "strict": "unknown keys are always refused, by name", "output_dir": None, "pad_to_sequence_len": "batches are padded or packed as needed",
    "dataset_prepared_path": "the tokenized cache is automatic", "wandb_entity": "set by W&B's own login",
}


# Names too short or common to tell anywhere (`type`, `r`): told only in the gpupoor section where another tool
# writes them. Keyed by (section, their key); a section's list items are `[]` (`data.datasets[]`: each entry).
SECTION_PEER_KEYS: dict[tuple[str, str], PeerKey] = {
    ("data.datasets[]", "type"): PeerKey("data.datasets[].format", AX, "text, alpaca, chat (their chat_template), "
                                         "sharegpt, completion or preference"),
    ("data", "type"): PeerKey("data.format", AX, "text, alpaca, chat (their chat_template), sharegpt, completion "
                              "or preference"),
    ("peft", "r"): PeerKey("peft.rank", "PEFT"),  # LoraConfig(r=...)
}


# Their chat template names for a family gpupoor ships a template of (gpupoor.data.chat_templates): LLaMA-Factory's
# `template:` values (its template.py) and axolotl's `chat_template:` values (its ChatTemplate enum). The same
# family's turns; each tool's text may differ in details (a default system prompt, whitespace).
PEER_TEMPLATE_NAMES: dict[str, dict[str, str]] = {
    "template": {"qwen": "qwen2.5", "llama3": "llama3", "llama2": "llama2", "mistral": "mistral", "gemma": "gemma",
                 "gemma3": "gemma", "phi": "phi3", "vicuna": "vicuna", "alpaca": "alpaca-chat",
                 "deepseek3": "deepseek", "deepseekr1": "deepseek", "smollm2": "smollm2", "chatml": "chatml"},
    "chat_template": {"qwen_25": "qwen2.5", "llama3": "llama3", "mistral_v2v3": "mistral", "gemma": "gemma",
                      "gemma3": "gemma", "phi_3": "phi3", "phi_35": "phi3", "deepseek_v2": "deepseek",
                      "deepseek_v3": "deepseek", "alpaca": "alpaca-chat", "chatml": "chatml"},
}


def peer_hint(key: str, where: tuple[str, ...], value: object = None) -> str | None:
    """`LLaMA-Factory's 'num_train_epochs' is gpupoor's 'training.epochs'` for a key another tool uses, unless it
    is already where gpupoor has it (then it is not unknown); for their template names, gpupoor's name too.
    `where`: the dotted parts above the key, a list item's index as digits ("data", "datasets", "0")."""
    found = SECTION_PEER_KEYS.get((_section(where, ""), key))
    if found is not None:  # told with this entry's own index: data.datasets[2].format
        found = PeerKey(f"{_section(where)}.{found.ours.rsplit('.', 1)[1]}", found.tools, found.note)
    else:
        found = PEER_KEYS.get(key)
    if found is None or ".".join((*where, key)) == found.ours:
        return None
    named = PEER_TEMPLATE_NAMES.get(key, {}).get(value) if isinstance(value, str) else None
    if named:
        return f"{found.tools}'s '{key}' is gpupoor's '{found.ours}', and its '{value}' is gpupoor's '{named}'"
    note = f": {found.note}" if found.note else ""
    return f"{found.tools}'s '{key}' is gpupoor's '{found.ours}'{note}"


def _section(where: tuple[str, ...], index: str | None = None) -> str:
    """("data", "datasets", "0") as data.datasets[0], or with `index` "" for any item, data.datasets[]."""
    return "".join(f"[{part if index is None else index}]" if part.isdigit() else f".{part}"
                   for part in where).lstrip(".")

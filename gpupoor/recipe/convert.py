"""`gpupoor convert-recipe`: a LLaMA-Factory or axolotl YAML as a gpupoor recipe.

Each of their keys goes where recipe/peer_keys.py (the table docs/migration.md shows) says it lives, with the value
changed where the two tools spell it differently (`lora_target: all` is `all-linear`, `bf16: true` is
`precision: bf16`, a `val_size` fraction becomes a count of rows). A LLaMA-Factory dataset name is looked up in its
`dataset_info.json` (in `dataset_dir`, default `data/` beside the YAML) for its file and formatting. Every key that
does not carry over is listed at the top of the written recipe with the reason: not needed in gpupoor (what it
does is automatic), no equivalent, or a value that needs a person. A value of the wrong kind (`max_samples: abc`,
`val_size: "0.1"`, a dataset entry that is not a mapping, a dataset_info.json that is not JSON) is refused, naming
the file:line and the key and what it takes, before anything is written: it would not train in their tool either.
Torch-free: it only reads YAML and JSON."""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpupoor.errors import UserError
from gpupoor.method_table import METHOD_NAMES, METHODS
from gpupoor.optimizers import OPTIMIZER_NAMES
from gpupoor.recipe.peer_keys import NOT_NEEDED, PEER_KEYS, PEER_TEMPLATE_NAMES
from gpupoor.recipe.schema import LoggingSection, PreferenceSection, TrainingSection

@dataclass
class Converted:
    out_dir: Path = Path(".")  # where the recipe is written: its file paths are relative to it
    recipe: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # one per key not carried over: "key: value: why"
    source: str = "their recipe"  # their file, for errors
    lines: dict[str, str] = field(default_factory=dict)  # their dotted key -> "file:line"
    read: list[Path] = field(default_factory=list)  # the files the conversion read or names: never its output

    def at(self, dotted: str) -> str:
        """Where their key is: file:line, or the file."""
        return self.lines.get(dotted, self.source)

    def set(self, dotted: str, value) -> None:
        node = self.recipe
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def note(self, key: str, value, why: str) -> None:
        self.notes.append(f"{key}: {json.dumps(value, default=str)}: {why}")


GIVE_THEIRS = "give a LLaMA-Factory or axolotl training YAML"


def convert_file(path: Path, out_dir: Path | None = None) -> Converted:
    """Their recipe at `path` converted (a UserError when it is not a readable YAML mapping, or a value is of the
    wrong kind); file paths relative to `out_dir`, where the recipe will be written (default: beside theirs)."""
    from gpupoor.recipe.loading import _line_map, _RecipeLoader, decode_utf8

    if not path.is_file():
        raise UserError(f"{path}: {'is a directory' if path.is_dir() else 'no such file'}", hint=GIVE_THEIRS)
    try:
        text = decode_utf8(path, path.read_bytes())
    except OSError as exc:
        raise UserError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        theirs = yaml.load(text, Loader=_RecipeLoader)  # refuses duplicate keys, keys that are not names
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise UserError(f"{path}:{mark.line + 1 if mark else 1}: not valid YAML: "
                        f"{getattr(exc, 'problem', None) or exc}", hint="fix the file and convert again") from None
    if theirs is None:
        raise UserError(f"{path}: it is empty: there is no recipe in it", hint=GIVE_THEIRS)
    if not isinstance(theirs, dict):
        raise UserError(f"{path}:1: a recipe is a mapping of keys to values, not {_kind(theirs)}", hint=GIVE_THEIRS)
    return convert(theirs, path.parent, out_dir or path.parent, source=path, lines=_line_map(text, str(path)))


def convert(theirs: dict, base_dir: Path, out_dir: Path, source: Path | None = None,
            lines: dict[str, str] | None = None) -> Converted:
    out = Converted(out_dir=out_dir.absolute(), source=str(source or "their recipe"), lines=lines or {},
                    read=[source] if source else [])
    _check_kinds(theirs, out)
    for key, value in theirs.items():
        if value is None:
            continue
        if key in READ_WITH_OTHERS:
            continue
        if key in ("dataset", "datasets"):
            _data(key, value, theirs, base_dir, out)
        elif key in SPECIAL:
            SPECIAL[key](key, value, theirs, out)
        elif key in NOT_NEEDED and NOT_NEEDED[key]:
            out.note(key, value, f"not needed in gpupoor: {NOT_NEEDED[key]}")
        elif key in PEER_KEYS and not PEER_KEYS[key].note:
            if not _constraint_note(key, value, out):
                out.set(PEER_KEYS[key].ours, value)
        else:
            where = f" (gpupoor's {PEER_KEYS[key].ours}: {PEER_KEYS[key].note})" if key in PEER_KEYS else ""
            out.note(key, value, f"no gpupoor equivalent carried over{where}; check docs/migration.md")
    _method(theirs, out)
    _template_unused_by_alpaca(theirs, out)
    out.recipe = {section: out.recipe[section] for section in sorted(out.recipe, key=_section_order)}
    return out


def _template_unused_by_alpaca(theirs: dict, out: Converted) -> None:
    """LLaMA-Factory renders alpaca rows through the chat template; gpupoor's alpaca format is the Alpaca prompt, where
    a chat template would go unused: said, and left out."""
    data = out.recipe.get("data", {})
    formats = [source.get("format") for source in data.get("datasets", [data])]
    if "chat_template" in data and formats and all(fmt == "alpaca" for fmt in formats):
        key = "template" if "template" in theirs else "chat_template"
        out.note(key, theirs[key], f"LLaMA-Factory renders alpaca rows through this chat template; gpupoor's "
                 f"alpaca format trains them on the Alpaca prompt, so it was left out (to train through the "
                 f"template, write the rows as chat rows and set data.format: chat, data.chat_template: "
                 f"{data['chat_template']})")
        del data["chat_template"]


# ------------------------------------------------------------------------------------------------ their values
# What each of their keys that the conversion reads must be; a key copied as it is (PEER_KEYS without a note) takes
# what gpupoor's key does (checked against the schema). A value of another kind is refused, not carried over: it is
# a typo or a quoting mistake that their tool would refuse too.
def _is_text(value) -> bool:
    return isinstance(value, str)


def _is_flag(value) -> bool:
    return isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_names(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(item, str) for item in value))


TEXT = (_is_text, "text")
FLAG = (_is_flag, "true or false")
KINDS: dict[str, tuple] = {
    "dataset": (_is_names, "dataset names from dataset_info.json, separated by commas (or a list of names)"),
    "datasets": (lambda v: isinstance(v, (list, dict)), "a list of datasets, each a mapping {path, type, ...}"),
    "dataset_dir": (_is_text, "a folder (text)"),
    "val_size": (lambda v: _is_number(v) and (0 <= v < 1 or float(v).is_integer()),
                 "a number: a fraction of the rows under 1 (0.1), or a whole number of rows (100)"),
    "max_samples": (_is_count, "a whole number of rows, 1 or more"),
    "finetuning_type": (_is_text, "a method name: lora, freeze or full"),
    "adapter": (_is_text, "a method name: lora or qlora"),
    "use_dora": FLAG, "load_in_4bit": FLAG, "load_in_8bit": FLAG, "lora_target_linear": FLAG,
    "packing": FLAG, "sample_packing": FLAG,
    "quantization_bit": (_is_count, "a whole number of bits: 4 or 8"),
    "pref_loss": (_is_text, "a loss name such as sigmoid or orpo"),
    "lora_target": (lambda v: _is_names(v) or _is_flag(v), "module names separated by commas, a list of names, "
                    "or all"),
    "stage": (_is_text, "a stage name: sft, dpo or orpo"),
    "rl": (_is_text, "a method name: dpo or orpo"),
    "bf16": (lambda v: _is_flag(v) or v == "auto", "true, false or auto"),
    "template": (_is_text, "a chat template name such as llama3"),
    "num_train_epochs": (lambda v: _is_number(v) and v > 0, "a number of epochs above 0, such as 3 or 1.5"),
    "flash_attn": (lambda v: _is_text(v) or _is_flag(v), "auto, fa2, sdpa or disabled"),
    "flash_attention": (lambda v: _is_text(v) or _is_flag(v), "true or false"),
    "report_to": (_is_names, "a tracker name or a list of them, such as wandb or none"),
    "lr_scheduler_type": (_is_text, "a schedule name such as cosine"),
    "optim": (_is_text, "an optimizer name such as adamw_torch"),
    "output_dir": TEXT, "wandb_project": TEXT,
    "pref_beta": (lambda v: _is_number(v) and v > 0, "a number above 0, such as 0.1"),
}
KINDS.update({"val_set_size": KINDS["val_size"], "lora_target_modules": KINDS["lora_target"], "fp16": KINDS["bf16"],
              "chat_template": KINDS["template"], "num_epochs": KINDS["num_train_epochs"],
              "lr_scheduler": KINDS["lr_scheduler_type"], "optimizer": KINDS["optim"]})


def _check_kinds(theirs: dict, out: Converted) -> None:
    """Refuse a value of the wrong kind, naming where it is, what it takes and what to do; a value of the right kind
    that gpupoor's key does not take (`max_steps: -1`) is noted and left out instead, where it is converted."""
    for key, value in theirs.items():
        if value is None:
            continue
        if key in KINDS:
            test, what = KINDS[key]
            if not test(value):
                raise _wrong_kind(out, key, value, what)
        elif key in PEER_KEYS and not PEER_KEYS[key].note and key not in SPECIAL:
            annotation = _schema_field(PEER_KEYS[key].ours).annotation
            if _schema_error(annotation, value) is not None:
                raise _wrong_kind(out, key, value, f"{_describe(annotation)} (gpupoor's {PEER_KEYS[key].ours})")


def _wrong_kind(out: Converted, key: str, value, what: str, dotted: str | None = None) -> UserError:
    """`key` (at their `dotted` key, default `key`) holds `value`, which is not `what` it takes."""
    return UserError(f"{out.at(dotted or key)}: {key}: {_short(value)} is {_kind(value)}; {key} takes {what}",
                     hint=f"fix it in {out.source} (or remove it) and convert again")


def _kind(value) -> str:
    """What a YAML or JSON value is, in words."""
    if isinstance(value, bool):
        return "true or false"
    for kinds, name in ((str, "text"), (int, "a whole number"), (float, "a number"), (list, "a list"),
                        (dict, "a mapping")):
        if isinstance(value, kinds):
            return name
    return f"a {type(value).__name__}"  # a date, bytes: YAML's other scalars


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _schema_field(dotted: str):
    """gpupoor's schema field at a dotted key (training.learning_rate)."""
    from gpupoor.recipe.schema import Recipe, section_model

    *sections, name = dotted.split(".")
    model = Recipe
    for section in sections:
        model = section_model(model.model_fields[section].annotation)
    return model.model_fields[name]


def _schema_error(annotation, value) -> str | None:
    """Why `value` is not of the type `annotation` (constraints aside), as pydantic says it; None when it is."""
    from pydantic import TypeAdapter, ValidationError

    try:
        TypeAdapter(annotation).validate_python(value)
    except ValidationError as exc:
        return exc.errors()[0]["msg"]
    return None


def _describe(annotation) -> str:
    """A schema type in words: `int | None` is "a whole number"."""
    names = {int: "a whole number", float: "a number", bool: "true or false", str: "text"}
    parts = []
    for member in typing.get_args(annotation) or (annotation,):
        if member is type(None):
            continue
        if typing.get_origin(member) is typing.Literal:
            parts += [str(choice) for choice in typing.get_args(member)]
        else:
            parts.append(names.get(member, getattr(member, "__name__", str(member))))
    return " or ".join(parts)


def _constraint_note(key: str, value, out: Converted) -> bool:
    """A value of the right kind that gpupoor's key does not take (`max_steps: -1`): noted, and left out."""
    from pydantic import TypeAdapter, ValidationError

    ours = _schema_field(PEER_KEYS[key].ours)
    if not ours.metadata:
        return False  # no bounds: the type was checked in _check_kinds
    try:
        TypeAdapter(typing.Annotated[(ours.annotation, *ours.metadata)]).validate_python(value)
    except ValidationError as exc:
        out.note(key, value, f"gpupoor's {PEER_KEYS[key].ours}: {exc.errors()[0]['msg'].lower()}: set it")
        return True
    return False


# Read with the keys they qualify (the data's, the method's).
READ_WITH_OTHERS = ("dataset_dir", "val_size", "val_set_size", "max_samples", "use_dora", "quantization_bit",
                    "load_in_4bit", "load_in_8bit", "finetuning_type", "adapter", "pref_loss")
SECTIONS = ("model", "data", "peft", "quantization", "training", "preference", "precision", "memory", "checkpoint",
            "logging", "output_dir")


def _section_order(section: str) -> int:
    """The order of gpupoor's own recipes."""
    return SECTIONS.index(section) if section in SECTIONS else len(SECTIONS)


def _method(theirs: dict, out: Converted) -> None:
    """peft.method and quantization from finetuning_type / adapter, use_dora and the quantization keys."""
    kind = str(theirs.get("finetuning_type") or theirs.get("adapter") or "lora").lower()
    if kind == "freeze":
        out.note("finetuning_type", "freeze", "gpupoor trains the last layers with peft.method full and "
                 "peft.last_layers N: set them")
        kind = "full"
    method = {"qlora": "lora"}.get(kind, kind)
    if method not in METHODS:
        out.note("finetuning_type" if "finetuning_type" in theirs else "adapter", kind, "not a method gpupoor "
                 f"trains ({', '.join(METHOD_NAMES)})")
        method = "lora"
    out.set("peft.method", "dora" if theirs.get("use_dora") and method == "lora" else method)
    bits = theirs.get("quantization_bit") or (4 if theirs.get("load_in_4bit") or kind == "qlora" else
                                              8 if theirs.get("load_in_8bit") else None)
    if bits:
        out.set("quantization.bits", int(bits))


def _targets(key, value, theirs, out):
    if value in ("all", "all-linear") or value is True:
        out.set("peft.target_modules", "all-linear")
    elif value is not False:
        out.set("peft.target_modules", [t.strip() for t in value.split(",")] if isinstance(value, str) else value)


def _objective(key, value, theirs, out):
    loss = theirs.get("pref_loss", "sigmoid")
    objective = {"sft": "sft", "dpo": "orpo" if loss == "orpo" else "dpo", "orpo": "orpo"}.get(str(value))
    if objective is None:
        out.note(key, value, "gpupoor trains sft, dpo and orpo (pretraining is sft on format: text)")
        return
    out.set("training.objective", objective)
    losses = _choices(PreferenceSection, "loss_type")
    if loss not in (*losses, "orpo"):
        out.note("pref_loss", loss, f"gpupoor's DPO losses are {', '.join(losses)} (preference.loss_type)")
    elif loss in losses and loss != "sigmoid":
        out.set("preference.loss_type", loss)


def _precision(key, value, theirs, out):
    if value == "auto":  # axolotl's: bf16 where the hardware has it, as gpupoor's auto
        out.set("precision", "auto")
    elif value:
        out.set("precision", key)


def _template(key, value, theirs, out):
    named = PEER_TEMPLATE_NAMES.get(key, {}).get(value, value)
    out.set("data.chat_template", named)
    if named == value and value not in PEER_TEMPLATE_NAMES.get(key, {}).values():
        out.note(key, value, "not a template name gpupoor ships: set data.chat_template to a name from docs/recipe.md "
                 "or Jinja text (it was copied as it is)")


def _epochs(key, value, theirs, out):
    out.set("training.epochs", int(value) if float(value).is_integer() else float(value))


def _attention(key, value, theirs, out):
    chosen = {"fa2": "flash_attention_2", True: "flash_attention_2", "sdpa": "sdpa", "auto": "auto",
              "disabled": "eager", False: "sdpa"}.get(value)
    if chosen is None:
        out.note(key, value, "gpupoor's model.attention is auto, flash_attention_2, sdpa or eager")
    else:
        out.set("model.attention", chosen)


def _report(key, value, theirs, out):
    wanted = [value] if isinstance(value, str) else list(value)
    known = typing.get_args(typing.get_args(LoggingSection.model_fields["report_to"].annotation)[0])
    trackers = [t for t in wanted if t in known]
    out.set("logging.report_to", trackers)
    for other in set(wanted) - set(trackers) - {"none"}:
        out.note(key, other, f"gpupoor reports to {', '.join(known)} (metrics.jsonl always)")


def _packing(key, value, theirs, out):
    if value:
        out.set("data.sampler", "packed")


# Their optimizer names that gpupoor spells otherwise (a name gpupoor has is kept as it is).
OPTIMIZER_ALIASES = {"adamw_torch": "adamw", "adamw_hf": "adamw", "adamw_torch_fused": "adamw",
                     "adamw_bnb_8bit": "adamw_8bit"}


def _optimizer(key, value, theirs, out):
    chosen = OPTIMIZER_ALIASES.get(value, value)
    if chosen in OPTIMIZER_NAMES:
        out.set("training.optimizer", chosen)
    else:
        out.note(key, value, f"gpupoor's optimizers are {', '.join(OPTIMIZER_NAMES)}")


def _scheduler(key, value, theirs, out):
    schedules = _choices(TrainingSection, "lr_scheduler")
    if value == "constant_with_warmup":
        value = "constant"  # gpupoor's warmup applies to every schedule
    if value in schedules:
        out.set("training.lr_scheduler", value)
    else:
        out.note(key, value, f"gpupoor's schedules are {', '.join(schedules)} (each after its warmup)")


def _choices(section, key: str) -> tuple:
    """The values a Literal key of the schema allows."""
    return typing.get_args(section.model_fields[key].annotation)


def _simple(ours: str):
    return lambda key, value, theirs, out: out.set(ours, value)


def _eval_data(key, value, theirs, out):
    out.note(key, value, "a held-out set: set data.eval_path to its file (or data.eval_rows to hold rows out)")


SPECIAL = {"lora_target": _targets, "lora_target_modules": _targets, "lora_target_linear": _targets,
           "stage": _objective, "rl": _objective, "bf16": _precision, "fp16": _precision, "template": _template,
           "chat_template": _template, "num_train_epochs": _epochs, "num_epochs": _epochs,
           "flash_attn": _attention, "flash_attention": _attention, "report_to": _report, "packing": _packing,
           "sample_packing": _packing, "output_dir": _simple("output_dir"), "lr_scheduler_type": _scheduler,
           "lr_scheduler": _scheduler, "optim": _optimizer, "optimizer": _optimizer,
           "pref_beta": _simple("preference.beta"), "wandb_project": _simple("logging.project"),
           "eval_dataset": _eval_data}


# ------------------------------------------------------------------------------------------------------ the data
LF_FORMATS = {"alpaca": "alpaca", "sharegpt": "sharegpt"}  # LLaMA-Factory's `formatting` -> data.format
AXOLOTL_TYPES = {"alpaca": "alpaca", "sharegpt": "sharegpt", "chat_template": "chat", "completion": "completion",
                 "text": "text"}


def _data(key: str, value, theirs: dict, base_dir: Path, out: Converted) -> None:
    """data.path / data.datasets, each source's format and field names, max_samples and val_size."""
    if key == "dataset":
        names = [name.strip() for name in (value if isinstance(value, list) else value.split(",")) if name.strip()]
        sources = [_lf_source(name, theirs, base_dir, out) for name in names]
    elif isinstance(value, list):
        sources = [_axolotl_source(entry, f"datasets[{index}]", f"datasets.{index}", out)
                   for index, entry in enumerate(value)]
    else:
        sources = [_axolotl_source(value, "datasets", "datasets", out)]
    out.read += [out.out_dir / source["path"] for source in sources]  # gpupoor reads them from there
    limit = theirs.get("max_samples")
    held_out = theirs.get("val_size") or theirs.get("val_set_size")
    for source in sources:
        if limit:
            source["max_rows"] = int(limit)
        if held_out:
            rows = _count_rows(out.out_dir / source["path"]) if held_out < 1 else None
            if held_out >= 1:
                source["eval_rows"] = int(held_out)
            elif rows:
                source["eval_rows"] = max(1, round(min(rows, limit or rows) * held_out))
            else:
                out.note("val_size", held_out, f"a fraction of {source['path']}, whose rows could not be counted "
                         "here: set data.eval_rows to a number of rows")
    if len(sources) == 1:
        for name, setting in sources[0].items():
            if name != "name":
                out.set(f"data.{name}", setting)
    elif sources:
        out.set("data.datasets", sources)


# What convert reads of a dataset_info.json entry, and what each must be (LLaMA-Factory's data/README.md).
INFO_KINDS = {"file_name": TEXT, "hf_hub_url": TEXT, "ms_hub_url": TEXT, "formatting": (_is_text, "alpaca or sharegpt"),
              "ranking": FLAG,
              "columns": (lambda v: isinstance(v, dict) and all(map(_is_text, v.values())),
                          'a mapping of their column names to the file\'s, such as {"prompt": "question"}'),
              "tags": (lambda v: isinstance(v, dict) and all(map(_is_text, v.values())),
                       'a mapping of their tag names to the file\'s, such as {"role_tag": "role"}')}


def _read_info(path: Path, out: Converted) -> dict:
    """A dataset_info.json: a mapping of dataset names to entries, or a UserError naming the file (and line)."""
    from gpupoor.recipe.loading import decode_utf8

    out.read.append(path)
    hint = "fix it (LLaMA-Factory reads it too) and convert again"
    try:
        info = json.loads(decode_utf8(path, path.read_bytes()))
    except OSError as exc:
        raise UserError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})", hint=hint) from None
    if not isinstance(info, dict):
        raise UserError(f"{path}: a dataset_info.json is a mapping of dataset names to their entries "
                        '({"name": {"file_name": ...}}), not ' + _kind(info), hint=hint)
    return info


def _lf_source(name: str, theirs: dict, base_dir: Path, out: Converted) -> dict:
    """One LLaMA-Factory dataset name, through dataset_info.json."""
    folder = Path(theirs.get("dataset_dir") or "data")
    candidates = [folder] if folder.is_absolute() else [base_dir / folder, Path.cwd() / folder]
    info_path = next((c / "dataset_info.json" for c in candidates if (c / "dataset_info.json").is_file()), None)
    info = _read_info(info_path, out) if info_path else {}
    entry = info.get(name)
    if entry is not None and not isinstance(entry, dict):
        raise UserError(f"{info_path}: {name!r} is {_kind(entry)}; a dataset's entry is a mapping such as "
                        '{"file_name": "rows.json", "formatting": "alpaca"}',
                        hint="fix it (LLaMA-Factory reads it too) and convert again")
    if not isinstance(entry, dict):
        where = f"{info_path} has no entry {name!r}" if info_path else \
            f"no dataset_info.json in {' or '.join(str(c) for c in candidates)}"
        out.note("dataset", name, f"a LLaMA-Factory dataset name ({where}): data.path was set to the name; give "
                 "the file instead")
        return {"name": name, "path": name}
    for field_name, (test, what) in INFO_KINDS.items():
        if entry.get(field_name) is not None and not test(entry[field_name]):
            raise UserError(f"{info_path}: {name!r}: {field_name}: {_short(entry[field_name])} is "
                            f"{_kind(entry[field_name])}; {field_name} takes {what}",
                            hint="fix it (LLaMA-Factory reads it too) and convert again")
    if entry.get("file_name"):
        path = (info_path.parent / entry["file_name"]).absolute()
        source = {"name": name, "path": os.path.relpath(path, out.out_dir)}
    else:
        source = {"name": name, "path": entry.get("hf_hub_url") or entry.get("ms_hub_url") or name}
    formatting = entry.get("formatting", "alpaca")
    columns, tags = entry.get("columns") or {}, entry.get("tags") or {}
    if entry.get("ranking"):
        source["format"] = "preference"
        out.note("dataset", name, "LLaMA-Factory's ranking rows (instruction or conversations, chosen, rejected) "
                 "become gpupoor's preference rows {prompt, chosen, rejected}: convert the rows to that shape")
    elif formatting == "sharegpt" and tags.get("role_tag") == "role":  # OpenAI-style messages
        source["format"], source["messages_field"] = "chat", columns.get("messages", "messages")
    elif formatting in LF_FORMATS:
        source["format"] = LF_FORMATS[formatting]
        if formatting == "sharegpt" and columns.get("messages", "conversations") != "conversations":
            source["conversations_field"] = columns["messages"]
    else:
        out.note("dataset", name, f"formatting {formatting!r}: gpupoor reads alpaca, sharegpt and chat rows")
    renamed = {k: v for k, v in columns.items() if (k, v) not in (("prompt", "instruction"), ("query", "input"),
                                                                  ("response", "output"), ("messages", "conversations"),
                                                                  ("messages", "messages"), ("chosen", "chosen"),
                                                                  ("rejected", "rejected"), ("system", "system"))}
    if renamed and formatting == "alpaca":
        out.note("dataset", name, f"columns {renamed}: gpupoor's alpaca rows are instruction, input, output: rename "
                 "the columns")
    return source


# What convert reads of an axolotl dataset entry, and what each must be. `type` may also be a mapping: axolotl's
# custom prompt format, noted.
ENTRY_KINDS = {"path": (_is_text, "a file, folder or hub dataset id"),
               "type": (lambda v: isinstance(v, (str, dict)), "a format name such as alpaca or chat_template"),
               "field_messages": TEXT, "split": TEXT}


def _axolotl_source(entry, label: str, dotted: str, out: Converted) -> dict:
    """One axolotl dataset entry, `label` (datasets[0]) at their key `dotted` (datasets.0)."""
    if not isinstance(entry, dict):
        raise _wrong_kind(out, label, entry, "a mapping such as {path: rows.jsonl, type: alpaca}", dotted)
    if entry.get("path") is None:
        raise UserError(f"{out.at(dotted)}: {label} has no path; an axolotl dataset is {{path, type, ...}}",
                        hint=f"give {label} a path (a file, folder or hub dataset id), or remove it, and convert "
                        "again")
    for name, (test, what) in ENTRY_KINDS.items():
        if entry.get(name) is not None and not test(entry[name]):
            raise _wrong_kind(out, f"{label}.{name}", entry[name], what, f"{dotted}.{name}")
    kind = entry.get("type") or "alpaca"
    source = {"path": entry["path"], "format": AXOLOTL_TYPES.get(str(kind).split(".")[0], "alpaca")}
    if isinstance(kind, dict):
        out.note(label, entry, "type: a custom prompt format: gpupoor reads "
                 f"{', '.join(AXOLOTL_TYPES)} (set as alpaca)")
    elif kind.split(".")[0] not in AXOLOTL_TYPES:
        out.note(label, entry, f"type {kind.split('.')[0]!r}: gpupoor reads {', '.join(AXOLOTL_TYPES)} "
                 "(set as alpaca)")
    if entry.get("field_messages"):
        source["messages_field"] = entry["field_messages"]
    if entry.get("split"):
        source["split"] = entry["split"]
    return source


def _count_rows(path: Path) -> int | None:
    """Rows of a local .json (an array) or .jsonl file; None for anything else."""
    try:
        if path.suffix == ".jsonl":
            return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
        if path.suffix == ".json":
            rows = json.loads(path.read_text(encoding="utf-8"))
            return len(rows) if isinstance(rows, list) else None
    except (OSError, ValueError):
        return None
    return None


def render(converted: Converted, source: Path) -> str:
    """The recipe as YAML, the keys not carried over listed as comments above it."""
    lines = [f"# Converted by gpupoor convert-recipe from {source.name}.",
             "# Check it with: gpupoor validate THIS_FILE (and gpupoor plan THIS_FILE for its memory and time)."]
    if converted.notes:
        lines.append("# Not carried over, and why:")
        lines += [f"#   {note}" for note in converted.notes]
    return "\n".join(lines) + "\n" + yaml.safe_dump(converted.recipe, sort_keys=False, allow_unicode=True)

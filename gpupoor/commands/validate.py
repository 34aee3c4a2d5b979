"""`gpupoor validate`: everything that can be checked without loading weights or torch.

Schema (done by load_recipe), every data source exists and parses in its own format, a chat template is there
for chat rows, the model resolves to a config. Hub ids are checked against the local cache and, when the network
allows, the hub itself. `validate --show` (show_rows) loads the tokenizer, never the weights.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpupoor.model import gguf
from gpupoor.model.builtin import resolve_model_path
from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.data.row_formats import FORMATS, FieldNames, Format
from gpupoor.data.loading import DataSource, Row, check_held_out, iter_rows, read_rows, resolve_source
from gpupoor.data.chat_templates import missing_template_error, resolve_chat_template
from gpupoor.objective_table import OBJECTIVES, objective_of, sections_unused
from gpupoor.errors import UserError
from gpupoor.recipe.loading import LoadedRecipe
from gpupoor.recipe.rules import MAX_PASSES, check_rows, check_tokenized_settings
from gpupoor.recipe.schema import DataSection, SourceSection
from gpupoor.units import format_bytes

PREFLIGHT_ROWS = 200  # rows train's preflight parses per data file (training reads every row itself)
# `gpupoor validate` checks every row of a source up to this size (alpaca rows: about 0.4 s); of a bigger one the
# first PREFLIGHT_ROWS, and says so: a bad row further on is found when training reads it.
WHOLE_CHECK_BYTES = 32 * 2**20
TEMPLATE_ROWS = 20  # rows rendered with a recipe's chat template
# Names transformers passes to a chat template from the tokenizer (its special tokens). validate has no tokenizer,
# so they get stand-ins: a template may use them without being flagged for an undefined name.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _named(model) -> str:
    """The base as one value: model.name_or_path, or the GGUF file model.gguf_file inside it."""
    return gguf.joined(model.name_or_path, model.gguf_file)


def check_model(value: str, base_dir: Path, key: str = "model.name_or_path") -> list[str]:
    local = resolve_model_path(value, base_dir)
    if local is not None and gguf.is_gguf(str(local)):
        gguf.require_tokenizer(gguf.read_gguf(local, key), key)  # its metadata only: the architecture, a tokenizer
        return []
    if local is not None:
        from gpupoor.model.shape import require_model_dir

        require_model_dir(local, key)
        return []
    if not _REPO_ID.match(value):
        raise UserError(f"{key}: {value!r} is neither a local directory nor a hub id (owner/name)")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(value, "config.json"), str):
        return []
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return [f"{key}: {value} is not in the local hub cache and HF_HUB_OFFLINE=1: not verified"]
    return _check_hub_model(value, key)


def _check_hub_model(value: str, key: str) -> list[str]:
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        model_info(value, timeout=5)
    except RepositoryNotFoundError:
        raise UserError(f"{key}: no model {value!r} on the hub (or it is private: "
                        "log in with `hf auth login`)") from None
    except GatedRepoError:
        return [f"{key}: {value} is gated: accept its license on the hub and log in"]
    except Exception as exc:  # no network, DNS, timeouts: we cannot tell, so do not fail the recipe
        return [f"{key}: could not reach the hub to check {value} ({type(exc).__name__})"]
    return []


def data_sources(data: DataSection) -> list[tuple[str, SourceSection]]:
    """(dotted key prefix, source) of each training source: `data` for a single `path`, else data.datasets[i]."""
    if data.datasets is None:
        return [("data", source) for source in data.sources()]
    return [(f"data.datasets[{number}]", source) for number, source in enumerate(data.sources())]


def check_training_data(loaded: LoadedRecipe, whole: RowCheck | None = None) -> list[str]:
    """Every source's path and eval_path parse in the source's own format; data.tokenized_path exists."""
    data = loaded.recipe.data
    if data.tokenized_path:
        return check_tokenized_path(data.tokenized_path, loaded.base_dir, data)
    warnings: list[str] = []
    for prefix, source in data_sources(data):
        warnings += check_data(source.path, f"{prefix}.path", loaded, source.split, source, whole)
        check_source_amounts(prefix, source, loaded.base_dir)
        if source.eval_path:
            warnings += check_data(source.eval_path, f"{prefix}.eval_path", loaded, "train", source, whole)
    return warnings + eval_is_training_data(loaded)


def eval_is_training_data(loaded: LoadedRecipe) -> list[str]:
    """A warning for each eval source that is a training source too (the same file, hard links and symlinks
    included, or the same split): its eval loss would measure how well the model memorised those rows."""
    data, base_dir = loaded.recipe.data, loaded.base_dir
    trained = [(f"{prefix}.path", resolve_source(source.path, base_dir, source.split, f"{prefix}.path"))
               for prefix, source in data_sources(data)]
    evaluated = [(f"{prefix}.eval_path", resolve_source(source.eval_path, base_dir, "train", f"{prefix}.eval_path"))
                 for prefix, source in data_sources(data) if source.eval_path]
    location = trained[0][1]
    if data.eval_split and location.kind != "file":  # a split of data.path (a file has none: training says so)
        evaluated.append(("data.eval_split", DataSource(location.kind, location.location, data.eval_split)))
    warnings = []
    for eval_key, evaluation in evaluated:
        same = next((key for key, training in trained if _same_data(evaluation, training)), None)
        if same is not None:
            split = "" if evaluation.kind == "file" else f" (split {evaluation.split})"
            warnings.append(f"{eval_key}: {evaluation.location}{split} is also training data ({same}): the eval loss "
                            "would measure how well the model memorised those rows, not how it does on rows it has "
                            "not seen; hold out rows with eval_rows, or evaluate on a separate file")
    return warnings


def _same_data(one, other) -> bool:
    if one.kind != other.kind or (one.kind != "file" and one.split != other.split):
        return False
    if one.kind == "hub":
        return one.location == other.location
    try:
        return os.path.samefile(one.location, other.location)
    except OSError:
        return False


def check_source_amounts(prefix: str, source: SourceSection, base_dir: Path) -> None:
    """A local source's rows against what the recipe takes of them, as training checks its usable examples: the
    rows `eval_rows` holds out leave some to train on (check_held_out), and `rows` per epoch is at most MAX_PASSES
    passes over the rest (check_rows). One read, of only as many rows as the checks need (a hub dataset's are
    counted when training starts)."""
    if not source.eval_rows and source.rows is None:
        return
    location = resolve_source(source.path, base_dir, source.split, f"{prefix}.path")
    if location.kind == "hub":
        return
    needed = source.eval_rows + max(1, -(-(source.rows or 0) // MAX_PASSES))
    limit = min(needed, source.max_rows) if source.max_rows else needed
    rows = sum(1 for _ in iter_rows(location, limit))
    if source.eval_rows:
        counted = (f"{prefix}.max_rows = {rows} keeps {rows} rows of {location.location}" if source.max_rows == rows
                   else f"{location.location} has {rows} rows")
        check_held_out(prefix, source.eval_rows, rows, counted)
    if source.rows is not None:
        what = "rows left after eval_rows" if source.eval_rows else "rows"
        check_rows(f"{prefix}.rows", source.rows, max(rows - source.eval_rows, 0), what)


def check_tokenized_path(value: str, base_dir: Path, data: DataSection | None = None) -> list[str]:
    # Its files are checked against the manifest when training opens it; here that it is there, and (given the
    # data section) that it was made with the recipe's max_length and format.
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.exists():
        raise UserError(f"data.tokenized_path: {path} does not exist",
                        hint="write it with `gpupoor tokenize`; relative paths resolve against the recipe file's "
                        "directory")
    if not path.is_dir():
        raise UserError(f"data.tokenized_path: {path} is not a directory (it is what `gpupoor tokenize` writes)")
    from gpupoor.data.tokenized_manifest import read_manifest

    manifest = read_manifest(path)  # none, or a damaged one, is refused here as training would refuse it
    if data is not None:
        check_tokenized_settings(manifest, data, path)
    return []


@dataclass
class RowCheck:
    """validate's reading of data sources: every row of one up to `whole_bytes`; of a bigger one the first
    PREFLIGHT_ROWS, and `note` says so."""

    whole_bytes: int
    note: Callable[[str], None]


def check_data(value: str, key: str, loaded: LoadedRecipe, split: str, source: SourceSection | None = None,
               whole: RowCheck | None = None) -> list[str]:
    """The rows of one data location parse in `source`'s format (default: the first source's): every row when
    `whole` allows it, else the first PREFLIGHT_ROWS; a chat or sharegpt source's rows also render with a
    data.chat_template."""
    data = loaded.recipe.data
    source = source or data.sources()[0]
    location = resolve_source(value, loaded.base_dir, split, key)
    if location.kind == "hub":
        return [f"{key}: {value} is a hub dataset name; its rows are checked when training starts"]
    size = _bytes_of(Path(location.location))
    every_row = whole is not None and size <= whole.whole_bytes
    data_format = source_format(source, data)
    rows: list[Row] = []  # the first PREFLIGHT_ROWS, for the template and the warnings; the rest checked and let go
    for row in iter_rows(location, None if every_row else PREFLIGHT_ROWS):
        data_format.check(row.fields, row.where, needs_assistant=not data.train_on_prompt)
        if len(rows) < PREFLIGHT_ROWS:
            rows.append(row)
    if not rows:
        raise UserError(f"{key}: {location.location} has no rows")
    if whole is not None and not every_row and len(rows) == PREFLIGHT_ROWS:
        whole.note(f"{key}: checked the first {PREFLIGHT_ROWS} rows of {location.location} ({format_bytes(size)}; "
                   f"validate reads a source whole up to {format_bytes(whole.whole_bytes)}): training checks every "
                   "other row as it reads it")
    template = resolve_chat_template(data.chat_template)
    conversations = [(row.where, messages) for row in rows[:TEMPLATE_ROWS]
                     if (messages := data_format.conversation(row.fields, row.where)) is not None]
    if conversations and template is not None:
        check_chat_template(template, conversations, data_format.conversation_field)
    elif conversations and not data_format.needs_chat_template:
        # Rows that turn out to be conversations (preference pairs as message lists): with no data.chat_template
        # the tokenizer's own renders them. (A format whose every row is one: check_tokenizer_template.)
        _check_tokenizer_renders(loaded, f"{data_format.name} (with message lists)")
    return data_format.warnings(rows, key, PREFLIGHT_ROWS)


def _bytes_of(path: Path) -> int:
    """A data file's size, or a saved dataset directory's files together."""
    if path.is_file():
        return path.stat().st_size
    return sum(part.stat().st_size for part in path.rglob("*") if part.is_file())


def source_format(source: SourceSection, data: DataSection) -> Format:
    """The format of a source's rows, with its field names."""
    return FORMATS[source.format](FieldNames.of(source, data.sharegpt_roles))


def _check_tokenizer_renders(loaded: LoadedRecipe, formats: str) -> None:
    model = loaded.recipe.model
    if tokenizer_has_chat_template(_named(model), loaded.base_dir, model.revision) is False:
        raise missing_template_error(f"{model.name_or_path}'s tokenizer", formats)


def _template_environment():
    """A jinja2 environment like the one transformers renders chat templates in (`_compile_jinja_template`:
    sandboxed, trim_blocks/lstrip_blocks, loopcontrols, `{% generation %}`, raise_exception, strftime_now, tojson,
    dict, namespace), but printing an undefined name is an error rather than silently empty text. (jinja2's
    StrictUndefined would also fail `{% if message.tool_calls %}`, which real templates such as Qwen2.5's use.)"""
    import json
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class PrintStrictUndefined(jinja2.Undefined):
        __str__ = jinja2.StrictUndefined.__str__

    class Generation(jinja2.ext.Extension):  # `{% generation %}...{% endgeneration %}` marks assistant text
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    class TemplateDict:  # `dict(...)` without the dict type itself (as transformers does, for the sandbox)
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=PrintStrictUndefined,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=jinja2.utils.Namespace)
    return env


def check_chat_template(template: str, conversations: list[tuple[str, list[dict]]], messages_field: str) -> None:
    """Render (where, messages) with data.chat_template the way training does (each prefix up to an assistant
    turn with the generation prompt, each longer prefix without), so a template that raises fails here, not
    mid-run."""
    import jinja2

    try:
        compiled = _template_environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"data.chat_template: not a valid Jinja template: {exc.message} (template line "
                        f"{exc.lineno})", hint="fix the template's syntax") from None
    tokens = {name: f"<{name}>" for name in _SPECIAL_TOKENS}
    for where, messages in conversations:
        for index, message in enumerate(messages):
            renders = [(messages[: index + 1], False)]
            if message["role"] == "assistant":
                renders.insert(0, (messages[:index], True))
            for prefix, generation_prompt in renders:
                try:
                    compiled.render(messages=prefix, tools=None, documents=None,
                                    add_generation_prompt=generation_prompt, **tokens)
                except Exception as exc:  # the template is user code
                    raise UserError(f"data.chat_template fails on {where} ({messages_field}[:{len(prefix)}], "
                                    f"add_generation_prompt={generation_prompt}): {type(exc).__name__}: {exc}",
                                    hint="fix the template (templates see messages, add_generation_prompt, "
                                    "tools, documents and the special tokens such as eos_token), or the row if "
                                    "the template rejects it on purpose") from None


def check_tokenizer_template(loaded: LoadedRecipe) -> list[str]:
    """A chat or sharegpt source with no data.chat_template needs the tokenizer's own template: read the
    tokenizer's files (no weights, no tokenizer load) to fail now rather than at training."""
    recipe = loaded.recipe
    formats = sorted({source.format for source in recipe.data.sources() if FORMATS[source.format].needs_chat_template})
    if recipe.data.chat_template is not None or not formats:
        return []
    name = _named(recipe.model)
    has_template = tokenizer_has_chat_template(name, loaded.base_dir, recipe.model.revision)
    if has_template is None:
        return [f"data.chat_template: not set, and {name}'s tokenizer files are not in the local hub cache, so "
                "whether it has a chat template is checked when training starts"]
    if not has_template:
        raise missing_template_error(f"{name}'s tokenizer", " and ".join(formats))
    return []


def tokenizer_has_chat_template(name_or_path: str, base_dir: Path, revision: str | None = None) -> bool | None:
    """Whether a model's tokenizer has a chat template, from its files: chat_template.jinja (how transformers
    5 saves it), additional_chat_templates/, or "chat_template" in tokenizer_config.json. None: cannot tell
    (a hub model whose files are not cached; validate does not download)."""
    local = resolve_model_path(name_or_path, base_dir)
    if local is not None and gguf.is_gguf(str(local)):
        return gguf.read_gguf(local).has_chat_template
    if local is not None:
        if (local / "chat_template.jinja").is_file() or any((local / "additional_chat_templates").glob("*.jinja")):
            return True
        config = local / "tokenizer_config.json"
        return config.is_file() and _config_has_template(config)
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str):  # a path, None (not known) or a marker that the file does not exist
        try:
            return try_to_load_from_cache(name_or_path, filename, revision=revision)
        except Exception:  # a malformed id: check_model reports it
            return None

    jinja, config = cached("chat_template.jinja"), cached("tokenizer_config.json")
    if isinstance(jinja, str) or (isinstance(config, str) and _config_has_template(Path(config))):
        return True
    if isinstance(config, str) and jinja is not None:  # the cache knows there is no chat_template.jinja
        return False
    return None


def _config_has_template(path: Path) -> bool:
    import json

    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # an unreadable tokenizer config: loading the tokenizer reports it
    return isinstance(config, dict) and bool(config.get("chat_template"))


# Module names of the Llama-family decoders (what `gpupoor plan` also covers), for checking peft names against
# the config alone. Other architectures are checked when the model is built.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
LLAMA_MODULES = frozenset({
    "model", "embed_tokens", "layers", "self_attn", "q_proj", "k_proj", "v_proj", "o_proj", "mlp", "gate_proj",
    "up_proj", "down_proj", "act_fn", "input_layernorm", "post_attention_layernorm", "norm", "rotary_emb",
    "lm_head", "q_norm", "k_norm"})


def check_module_names(loaded: LoadedRecipe) -> list[str]:
    """peft.target_modules / modules_to_save names that no module of a Llama-family model has (exit 2)."""
    from gpupoor.model.shape import find_config

    peft = loaded.recipe.peft
    wanted = {"peft.target_modules": peft.target_modules if isinstance(peft.target_modules, list) else [],
              "peft.modules_to_save": peft.modules_to_save}
    if not any(wanted.values()):
        return []
    try:
        config, _ = find_config(_named(loaded.recipe.model), loaded.base_dir, loaded.recipe.model.revision)
    except UserError:
        return []  # the plan reports a config it cannot read
    if config.get("model_type") not in LLAMA_FAMILY:
        return []
    for key, names in wanted.items():
        # Dotted names ("layers.0.mlp") and regex-like names are left to the model build, which checks them all.
        unmatched = [name for name in names if re.fullmatch(r"\w+", name) and name not in LLAMA_MODULES]
        if unmatched:
            raise UserError(f"{key}: {', '.join(map(repr, unmatched))} match no module of "
                            f"{loaded.recipe.model.name_or_path} ({config.get('model_type')})",
                            hint="its modules are named: " + ", ".join(sorted(LLAMA_MODULES - {"model"})))
    return []


def check_last_layers(loaded: LoadedRecipe) -> list[str]:
    """peft.last_layers against the decoder layers the model's config says it has (the rule training applies,
    decisions.trained_layer_indices), so validate refuses what the model build would."""
    from gpupoor.decisions import trained_layer_indices
    from gpupoor.model.shape import find_config

    recipe = loaded.recipe
    if recipe.peft.last_layers is None:
        return []
    try:
        config, _ = find_config(_named(recipe.model), loaded.base_dir, recipe.model.revision)
    except UserError:
        return []  # the plan reports a config it cannot read
    layers = (config.get("text_config") or config).get("num_hidden_layers")
    if isinstance(layers, int) and not isinstance(layers, bool):
        trained_layer_indices(recipe.peft.last_layers, layers)
    return []


def check_trackers(report_to: list[str]) -> None:
    from gpupoor.train.trackers import TRACKERS, missing_trackers

    missing = missing_trackers(report_to)
    if missing:
        # The extras are gpupoor's own, installed from its clone: `pip install 'gpupoor[wandb]'` would fetch an
        # unrelated project of that name from PyPI.
        raise UserError(f"logging.report_to names {', '.join(missing)} but its package is not installed here",
                        hint="pip install " + " ".join(TRACKERS[name][1] for name in missing) + " (from gpupoor's "
                        "clone: pip install -e '.[" + ",".join(missing) + "]'), or remove it from logging.report_to "
                        "(metrics.jsonl always has every record)")


def preflight(loaded: LoadedRecipe, whole: RowCheck | None = None) -> list[str]:
    """Raise UserError on the first definite problem; return warnings for what could not be checked. `whole`
    (validate's): check every row of the data sources it allows; else (train's) the first PREFLIGHT_ROWS of each,
    as training then reads every row itself."""
    recipe = loaded.recipe
    check_trackers(recipe.logging.report_to)
    warnings = check_model(_named(recipe.model), loaded.base_dir)
    warnings += check_module_names(loaded)
    warnings += check_last_layers(loaded)
    if recipe.distill is not None:
        warnings += check_model(recipe.distill.teacher, loaded.base_dir, "distill.teacher")
    warnings += check_training_data(loaded, whole)
    warnings += check_tokenizer_template(loaded)
    warnings += silent_settings(recipe)
    if objective_of(recipe).samples:
        check_rewards_import(recipe.grpo)
    if recipe.peft.init_adapter:  # (imports torch: only when there is an adapter to check)
        from gpupoor.model.init_adapter import check_init_adapter

        check_init_adapter(loaded)
    return warnings


def check_rewards_import(grpo) -> None:
    """Each `module:function` reward imports and is a function (its module's code runs now, as training would run
    it): a typo or a missing file said at validate, not after the model has loaded."""
    from gpupoor.scorers import parse_scorer

    for index, reward in enumerate(grpo.rewards):
        parse_scorer(reward.scorer, f"grpo.rewards[{index}].scorer", unit_range=False)


def silent_settings(recipe) -> list[str]:
    """Settings that would otherwise change nothing, or change something else, without a word."""
    from gpupoor.decisions import choose_sampler

    said = []
    sampler = choose_sampler(recipe.data.sampler, "sdpa", recipe.model.trust_remote_code, recipe.training.objective)
    if recipe.data.sampler == "auto" and recipe.model.trust_remote_code and sampler.value != "packed":
        said.append(f"model.trust_remote_code: true turns packing off: data.sampler auto is {sampler.value} "
                    f"({sampler.reason}); set data.sampler: packed if the model's own code isolates packed examples")
    formats = sorted({source.format for source in recipe.data.sources()})
    if recipe.data.chat_template and formats and not any(FORMATS[f].may_use_chat_template for f in formats):
        said.append(f"data.chat_template ({recipe.data.chat_template}) is unused: format {', '.join(formats)} renders "
                    "no chat template" + (" (alpaca rows are trained on the Alpaca prompt; for a chat template, "
                                          "write them as chat rows with data.format: chat)" if "alpaca" in formats
                                          else ""))
    for section in sections_unused(recipe):
        readers = [o.name for o in OBJECTIVES.values() if o.section == section]
        said.append(f"the {section} section ({', '.join(sorted(getattr(recipe, section).model_fields_set))}) is "
                    f"unused: training.objective is {recipe.training.objective}; it is read by training.objective "
                    f"{' or '.join(readers)}")
    return said


TRAINED_OPEN, TRAINED_CLOSE = "«", "»"  # around trained text in `validate --show`


def show_rows(loaded: LoadedRecipe, count: int, colour: bool = False) -> list[str]:
    """`validate --show N`: the first N rows of each source exactly as training tokenizes them (the same
    Encoder), decoded back, trained tokens between « » (and in colour on a terminal), with token counts."""
    from gpupoor.data.build import make_encoder
    from gpupoor.model.load import load_tokenizer, model_location
    from gpupoor.quiet import quiet_libraries

    recipe = loaded.recipe
    if recipe.data.tokenized_path:
        return ["data.tokenized_path holds rows `gpupoor tokenize` already tokenized: --show renders rows of "
                "data.path or data.datasets"]
    quiet_libraries()
    tokenizer = load_tokenizer(model_location(recipe.model, loaded.base_dir), recipe.model)
    lines = [f"trained tokens are between {TRAINED_OPEN} {TRAINED_CLOSE}; the first token is never a target"]
    for prefix, source in data_sources(recipe.data):
        encoder = make_encoder(recipe.data, tokenizer, source)
        location = resolve_source(source.path, loaded.base_dir, source.split, f"{prefix}.path")
        label = f"{prefix}.path" if recipe.data.datasets is None else f"{prefix} ({source.name})"
        for row in read_rows(location, min(count, source.max_rows or count)):
            lines += show_row(encoder, row, label, colour)
    return lines


def show_row(encoder, row: Row, label: str, colour: bool = False) -> list[str]:
    """One row: a header (where, token counts, truncation) and its text with the trained spans marked."""
    import typer

    encoded = encoder.encode(row.fields, row.where)
    bounds = (0, *encoded.sequence_starts, len(encoded.input_ids))  # a preference pair: chosen, then rejected
    names = ("chosen", "rejected") if encoded.sequence_starts else ("",)
    lines, empty = [], False
    for name, start, end in zip(names, bounds, bounds[1:]):
        ids, labels = encoded.input_ids[start:end], encoded.labels[start:end]
        # What training counts (dataset.tokenize_rows): position 0 is never predicted, so it is never a target.
        trained = [False] + [label_id != IGNORE_INDEX for label_id in labels[1:]]
        empty = empty or not any(trained)
        text = f"{name}: " if name else ""
        for is_trained, piece in _decoded_runs(encoder.tokenizer, ids, trained):
            if is_trained:
                piece = TRAINED_OPEN + piece + TRAINED_CLOSE
                piece = typer.style(piece, fg="green", bold=True) if colour else piece
            text += piece
        lines.append((len(ids), sum(trained), text))
    counts = " + ".join(f"{tokens} tokens, {trained} trained" for tokens, trained, _ in lines)
    header = f"--- {label} {row.where}: {counts}"
    if encoded.truncated:
        header += f", truncated to data.max_length = {encoder.max_length}" + (" each" if len(lines) > 1 else "")
    if empty:
        header += "; no trained tokens" + (" in one answer" if len(lines) > 1 else "") + ", so training drops this row"
    return [header] + [text for _, _, text in lines]


def _decoded_runs(tokenizer, ids: list[int], trained: list[bool]) -> list[tuple[bool, str]]:
    """(trained, text) for each run of tokens with the same state. Each run's text is the difference of the
    decoded prefixes, so spaces a tokenizer attaches to the next token stay where decoding the whole row puts
    them; a prefix that does not decode to a prefix (a character split across runs) falls back to the run alone."""
    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    runs, start, done = [], 0, ""
    for end in range(1, len(ids) + 1):
        if end < len(ids) and trained[end] == trained[start]:
            continue
        upto = decode(ids[:end])
        piece = upto[len(done):] if upto.startswith(done) else decode(ids[start:end])
        runs.append((trained[start], piece))
        start, done = end, upto
    return runs


def validate_recipes(recipes: list[Path], overrides: list[str], force: bool, show: int, debug: bool, *,
                     say: Callable[[str], None], err: Callable[[str], None], colour: bool) -> int:
    """`gpupoor validate`: each recipe checked (`preflight`, then the memory plan) and said ok or its error, the
    next one checked either way. Exit 2 when one is bad input, 1 when a check crashed (a bug), else 0."""
    from gpupoor.errors import EXIT_BAD_INPUT, EXIT_FAILED
    from gpupoor.plan.make import preflight_plan
    from gpupoor.recipe.loading import load_recipe

    failed = crashed = 0
    for path in recipes:
        try:
            loaded = load_recipe(path, overrides)
            notes: list[str] = []  # sources too big to read whole: which rows were checked
            warnings = preflight(loaded, RowCheck(WHOLE_CHECK_BYTES, notes.append))
            plan = preflight_plan(loaded, force, warnings.append)
            rows = show_rows(loaded, show, colour=colour) if show else []
            for warning in warnings:
                err(f"{path}: warning: {warning}")
            memory = "" if plan is None else f" (predicted peak {format_bytes(plan.peak)} on {plan.device})"
            say("\n".join([f"{path}: ok{memory}", *(f"{path}: note: {note}" for note in notes), *rows]))
        except UserError as exc:
            if debug:
                raise
            err(f"{path}: error: {exc}")
            failed += 1
        except Exception as exc:  # a bug, not bad input: report it (exit 1) but still check the next recipe
            if debug:
                raise
            err(f"{path}: error: {type(exc).__name__}: {exc}\n  (run again with --debug for the traceback)")
            crashed += 1
    return EXIT_FAILED if crashed else EXIT_BAD_INPUT if failed else 0

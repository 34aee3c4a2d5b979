"""`gpupoor validate`: everything that can be checked without loading weights or torch.

Schema (done by load_recipe), data files exist and parse in the recipe's format, the model resolves to a
config. Hub ids are checked against the local cache and, when the network allows, the hub itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpupoor.data.formats import check_row
from gpupoor.data.loading import Row, read_rows, resolve_source
from gpupoor.errors import UserError
from gpupoor.builtin_models import resolve_model_path
from gpupoor.recipe import LoadedRecipe

PREFLIGHT_ROWS = 200  # rows parsed per data file: enough to catch a wrong format, fast on big files
TEMPLATE_ROWS = 20  # rows rendered with a recipe's chat template
# Names transformers passes to a chat template from the tokenizer (its special tokens). validate has no tokenizer,
# so they get stand-ins: a template may use them without being flagged for an undefined name.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_model(value: str, base_dir: Path, key: str = "model.name_or_path") -> list[str]:
    local = resolve_model_path(value, base_dir)
    if local is not None:
        if not local.is_dir():
            raise UserError(f"{key}: {local} does not exist",
                            hint="relative paths resolve against the recipe file's directory")
        if not (local / "config.json").is_file():
            raise UserError(f"{key}: {local} has no config.json; it is not a model saved with "
                            "save_pretrained")
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


def check_data(value: str, key: str, loaded: LoadedRecipe, split: str) -> list[str]:
    data = loaded.recipe.data
    source = resolve_source(value, loaded.base_dir, split, key)
    if source.kind == "hub":
        return [f"{key}: {value} is a hub dataset name; its rows are checked when training starts"]
    rows = read_rows(source, PREFLIGHT_ROWS)
    if not rows:
        raise UserError(f"{key}: {source.location} has no rows")
    for row in rows:
        check_row(row.fields, row.where, data.format, data.text_field, data.messages_field,
                  needs_assistant=not data.train_on_prompt)
    if data.format == "chat" and data.chat_template is not None:  # the tokenizer's own template is trusted
        check_chat_template(data.chat_template, rows[:TEMPLATE_ROWS], data.messages_field)
    return []


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


def check_chat_template(template: str, rows: list[Row], messages_field: str) -> None:
    """Render rows with data.chat_template the way training does (each prefix up to an assistant turn with the
    generation prompt, each longer prefix without), so a template that raises fails here, not mid-run."""
    import jinja2

    try:
        compiled = _template_environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"data.chat_template: not a valid Jinja template: {exc.message} (template line "
                        f"{exc.lineno})", hint="fix the template's syntax") from None
    tokens = {name: f"<{name}>" for name in _SPECIAL_TOKENS}
    for row in rows:
        messages = row.fields[messages_field]
        for index, message in enumerate(messages):
            renders = [(messages[: index + 1], False)]
            if message["role"] == "assistant":
                renders.insert(0, (messages[:index], True))
            for prefix, generation_prompt in renders:
                try:
                    compiled.render(messages=prefix, tools=None, documents=None,
                                    add_generation_prompt=generation_prompt, **tokens)
                except Exception as exc:  # the template is user code
                    raise UserError(f"data.chat_template fails on {row.where} ({messages_field}[:{len(prefix)}], "
                                    f"add_generation_prompt={generation_prompt}): {type(exc).__name__}: {exc}",
                                    hint="fix the template (templates see messages, add_generation_prompt, "
                                    "tools, documents and the special tokens such as eos_token), or the row if "
                                    "the template rejects it on purpose") from None


# Module names of the Llama-family decoders (what `gpupoor plan` also covers), for checking peft names against
# the config alone. Other architectures are checked when the model is built.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
LLAMA_MODULES = frozenset({
    "model", "embed_tokens", "layers", "self_attn", "q_proj", "k_proj", "v_proj", "o_proj", "mlp", "gate_proj",
    "up_proj", "down_proj", "act_fn", "input_layernorm", "post_attention_layernorm", "norm", "rotary_emb",
    "lm_head", "q_norm", "k_norm"})


def check_module_names(loaded: LoadedRecipe) -> list[str]:
    """peft.target_modules / modules_to_save names that no module of a Llama-family model has (exit 2)."""
    from gpupoor.plan import find_config

    peft = loaded.recipe.peft
    wanted = {"peft.target_modules": peft.target_modules if isinstance(peft.target_modules, list) else [],
              "peft.modules_to_save": peft.modules_to_save}
    if not any(wanted.values()):
        return []
    try:
        config, _ = find_config(loaded.recipe.model.name_or_path, loaded.base_dir, loaded.recipe.model.revision)
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


def check_trackers(report_to: list[str]) -> None:
    from gpupoor.trackers import missing_trackers

    missing = missing_trackers(report_to)
    if missing:
        raise UserError(f"logging.report_to names {', '.join(missing)} but its package is not installed here",
                        hint="pip install " + " ".join(f"'{extra}'" for extra in missing) + ", or remove it from "
                        "logging.report_to (metrics.jsonl always has every record)")


def preflight(loaded: LoadedRecipe) -> list[str]:
    """Raise UserError on the first definite problem; return warnings for what could not be checked."""
    recipe = loaded.recipe
    check_trackers(recipe.logging.report_to)
    warnings = check_model(recipe.model.name_or_path, loaded.base_dir)
    warnings += check_module_names(loaded)
    if recipe.distill is not None:
        warnings += check_model(recipe.distill.teacher, loaded.base_dir, "distill.teacher")
    warnings += check_data(recipe.data.path, "data.path", loaded, recipe.data.split)
    if recipe.data.eval_path:
        warnings += check_data(recipe.data.eval_path, "data.eval_path", loaded, "train")
    return warnings

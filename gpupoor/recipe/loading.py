"""Reading a recipe file: YAML with the file:line of every key, `extends:` bases merged under it, `--set`
overrides, validation against the schema, and errors that say where (file:line or the --set, and the dotted key).

Also the recipe's JSON schema as a file sees it (the schema plus `extends`), and the paths a recipe names.
Imports no torch, so `gpupoor validate` and `--help` stay fast.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gpupoor.errors import UserError
from gpupoor.recipe.peer_keys import NOT_NEEDED, peer_hint
from gpupoor.recipe.schema import ADDED_MARK, Recipe, section_model


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
        elif isinstance(node, yaml.SequenceNode) and prefix:  # data.datasets.0.path: pydantic's location of it
            for index, item in enumerate(node.value):
                lines[f"{prefix}.{index}"] = f"{source}:{item.start_mark.line + 1}"
                walk(item, f"{prefix}.{index}")

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


class _RefusedKey(yaml.constructor.ConstructorError):
    """A mapping key a recipe cannot have: not text (a list, a mapping, a number, null, a date)."""


MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *base`: the anchor's keys merged in (an override is no duplicate)


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str):  # `? [a, b]`, `1:`, `null:`: every recipe key is a name
            raise _RefusedKey(None, None, _not_a_name(key_node, key), key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key]})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


def _not_a_name(key_node: yaml.Node, key: Any) -> str:
    """Why a key that is not text cannot be a recipe key, and how to write it as one."""
    if isinstance(key_node, (yaml.SequenceNode, yaml.MappingNode)):  # YAML's `? ` complex key
        kind = "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping"
        return (f"a key here is {kind}, {_short(_node_text(key_node))}, not a name: recipe keys are names such as "
                "`training:` or `learning_rate:`; a list or mapping goes after the colon, as the value")
    kinds = {bool: "a boolean", int: "a number", float: "a number"}
    kind = "null" if key is None else kinds.get(type(key), f"a {type(key).__name__}")  # date, datetime, bytes
    if not key_node.value:
        return "a key here is empty (nothing before its colon): recipe keys are names such as `training:`"
    return (f"the key {key_node.value} is read as {kind}, not a name: recipe keys are names such as `training:`; "
            f"quote it (\"{key_node.value}\":) if it is meant as text")


def _node_text(node: yaml.Node) -> str:
    """A node as flow-style YAML, for a message (composed nodes only: nothing is constructed)."""
    if isinstance(node, yaml.SequenceNode):
        return "[" + ", ".join(_node_text(child) for child in node.value) + "]"
    if isinstance(node, yaml.MappingNode):
        return "{" + ", ".join(f"{_node_text(k)}: {_node_text(v)}" for k, v in node.value) + "}"
    return str(node.value)


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
    """Field names allowed at the parent of an error location (in a list of sections, an item's: data.datasets.0)."""
    model: type[BaseModel] | None = Recipe
    for part in loc[:-1]:
        if model is not None and str(part).isdigit():  # an item of the list of sections the last part named
            continue
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        model = _field_section(model.model_fields[part].annotation)
    return list(model.model_fields) if model else []


def _keys_named(name: str) -> list[str]:
    """Every dotted recipe key whose last part is `name` (top-level and each section's, not list items')."""
    found = [name] if name in Recipe.model_fields and section_model(Recipe.model_fields[name].annotation) is None \
        else []
    for section, info in Recipe.model_fields.items():
        model = section_model(info.annotation)
        if model is not None and name in model.model_fields:
            found.append(f"{section}.{name}")
    return found


def _field_section(annotation) -> type[BaseModel] | None:
    """The section a field holds, or each item of a list of sections holds (`list[SourceSection] | None`)."""
    found = section_model(annotation)
    if found is None:
        lists = [option for option in (annotation, *typing.get_args(annotation)) if typing.get_origin(option) is list]
        found = next((section_model(typing.get_args(option)[0]) for option in lists), None)
    return found


MAX_REPORTED_ERRORS = 50  # every error a person could fix in one pass; a runaway file is cut short
# Values other tools' recipes put where gpupoor has a key of another spelling: (dotted key, their value) -> ours.
PEER_VALUES = {("peft.target_modules", "all"): "all-linear"}
MAX_VALUE_CHARS = 200


def _short(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """repr(value), cut to `limit` characters: a huge value must not make a huge error message."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _union_members_merged(errors: list[dict]) -> list[dict]:
    """One error per key: pydantic reports a value that fits no member of a union once per member, with the
    member's type appended to the location (`peft.target_modules.list[str]`, `....literal['all-linear']`); those
    become one error at the key, their messages joined with "or"."""
    merged: dict[tuple, dict] = {}
    for err in errors:
        loc = tuple(err["loc"])
        while loc and isinstance(loc[-1], str) and (loc[-1][:1].islower() and ("[" in loc[-1] or loc[-1] in
                                                                              ("str", "int", "float", "bool"))):
            loc = loc[:-1]
        if loc in merged and loc != tuple(err["loc"]):
            merged[loc]["msg"] += " or " + err["msg"].removeprefix("Input should be ")
        else:
            merged.setdefault(loc, {**err, "loc": loc})
    return _list_items_merged(list(merged.values()))


def _list_items_merged(errors: list[dict]) -> list[dict]:
    """The same error in many items of one list (5000 numbers where names belong) as one error at the list."""
    groups: dict[tuple, list[dict]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        key = (loc[:-1], err["msg"]) if loc and isinstance(loc[-1], int) else (loc, err["msg"], id(err))
        groups.setdefault(key, []).append(err)
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        shown = ", ".join(str(err["loc"][-1]) for err in group[:5]) + (", ..." if len(group) > 5 else "")
        merged.append({**group[0], "loc": tuple(group[0]["loc"][:-1]), "input": f"{len(group)} items",
                       "msg": f"items {shown} ({len(group)} in all): {group[0]['msg']}"})
    return merged


def _line_of(err: dict, lines: dict[str, str]) -> int:
    """The file line an error is at (for listing them in file order; unknown: last)."""
    key = ".".join(str(p) for p in err["loc"])
    while key and key not in lines:  # the nearest enclosing key in the file, as _where points
        key = key.rpartition(".")[0]
    line = lines.get(key, "").rsplit(":", 1)[-1]
    return int(line) if line.isdigit() else 10**9


def format_validation_error(exc: ValidationError, source: str, lines: dict[str, str],
                            overridden: set[str]) -> str:
    messages = []
    errors = sorted(_union_members_merged(exc.errors()), key=lambda err: _line_of(err, lines))
    for err in errors[:MAX_REPORTED_ERRORS]:
        where = _where(".".join(str(p) for p in err["loc"]), source, lines, overridden)
        loc = tuple(str(p) if len(str(p)) <= MAX_VALUE_CHARS else str(p)[: MAX_VALUE_CHARS - 3] + "..."
                    for p in err["loc"])  # a huge unknown key must not make a huge message
        dotted = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc)
            guess = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            msg = f"{where}: unknown key '{dotted}'"
            peer = peer_hint(str(loc[-1]), loc[:-1], err.get("input"))
            if str(loc[-1]) in NOT_NEEDED and NOT_NEEDED[str(loc[-1])]:
                msg += f"; not needed in gpupoor ({NOT_NEEDED[str(loc[-1])]}): remove it"
            elif peer:  # a key from another tool's recipes: say where gpupoor has it, not a spelling guess
                msg += f"; {peer}"
            elif _keys_named(str(loc[-1])):  # a key of another section (training.seed): where it is
                msg += f"; it is {' or '.join(repr(k) for k in _keys_named(str(loc[-1])))}"
            elif guess:
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
                msg = f"{where}: '{dotted}' = {_short(err.get('input'))}: {detail}{_peer_value(dotted, err)}"
        messages.append(msg)
    if len(errors) > MAX_REPORTED_ERRORS:
        messages.append(f"... and {len(errors) - MAX_REPORTED_ERRORS} more errors")
    return "invalid recipe:\n  " + "\n  ".join(messages) + \
        "\n  see docs/recipe.md or `gpupoor schema` for every key"


def _peer_value(dotted: str, err: dict) -> str:
    """What gpupoor calls a value another tool's recipes use there, or how a fraction becomes a count."""
    value = err.get("input")
    if isinstance(value, str) and (dotted, value) in PEER_VALUES:
        return f"; LLaMA-Factory's {value!r} is gpupoor's {PEER_VALUES[dotted, value]!r}"
    if dotted.endswith("eval_rows") and isinstance(value, float) and 0 < value < 1:
        return (f"; eval_rows is a number of rows, not a fraction (LLaMA-Factory's val_size): {value:g} of 1000 rows "
                f"is {round(1000 * value)}")
    return ""


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


def recipe_json_schema() -> dict:
    """The JSON schema of a recipe file: the Recipe model plus `extends`, which loading resolves (a base
    recipe whose keys this file's keys are merged over). The schema's ADDED marks are gpupoor's bookkeeping for
    resumes (gpupoor.recipe.diff), not something an editor needs: left out."""
    schema = Recipe.model_json_schema()
    schema["properties"] = {"extends": {"type": "string", "title": "Extends", "description": "A base recipe (path "
                                        "relative to this file) whose keys this file's keys are deep-merged over."},
                            **schema["properties"]}
    for properties in [schema["properties"], *(model.get("properties", {}) for model in schema["$defs"].values())]:
        for prop in properties.values():
            prop.pop(ADDED_MARK, None)
    return schema


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
        if isinstance(exc, (_RefusedYAML, _RefusedKey)):
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
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):  # data.datasets.0
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
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

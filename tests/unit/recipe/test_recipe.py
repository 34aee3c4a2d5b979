"""Recipe schema, YAML loading, --set overrides and errors: one test per validation rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from gpupoor.decisions import choose_reference
from gpupoor.errors import UserError
from gpupoor.recipe.diff import ADDED_KEYS, trajectory_hash
from gpupoor.recipe.loading import apply_overrides, load_recipe
from gpupoor.recipe.schema import (DistributedSection, PeftSection, QuantizationSection, Recipe, TrainingSection,
                                   is_added, is_resume_safe, section_model)
from gpupoor.units import parse_duration

ROOT = Path(__file__).resolve().parents[3]

MINIMAL = "model:\n  name_or_path: some/model\ndata:\n  path: train.jsonl\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(UserError) as info:
        load_recipe(path, overrides)
    return str(info.value)


def test_minimal_recipe_gets_documented_defaults(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL)).recipe
    assert recipe.precision == "auto" and recipe.peft.rank == 16 and recipe.peft.effective_alpha == 32
    assert recipe.data.format == "text" and recipe.training.micro_batch_size == 1 and recipe.seed == 42


def test_unknown_key_names_line_and_suggests(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "training:\n  learning_rat: 0.1\n"))
    assert "r.yaml:6" in message
    assert "unknown key 'training.learning_rat'" in message
    assert "did you mean 'training.learning_rate'" in message


def test_unknown_top_level_section(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "optimiser: adamw\n"))
    assert "unknown key 'optimiser'" in message and "allowed here:" in message and "training" in message


def test_wrong_type_names_key_value_and_line(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "training:\n  micro_batch_size: many\n"))
    assert "r.yaml:6" in message and "'training.micro_batch_size' = 'many'" in message and "integer" in message


def test_value_out_of_range(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "peft:\n  rank: 0\n"))
    assert "'peft.rank' = 0" in message and "greater than or equal to 1" in message


def test_choice_lists_allowed_values(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "precision: fp8\n"))
    assert "'precision' = 'fp8'" in message and "'bf16'" in message and "'fp32'" in message


def test_missing_required_key(tmp_path):
    message = error_of(write(tmp_path, "model:\n  name_or_path: x/y\n"))
    assert "'data' is required" in message


def test_duplicate_key_is_an_error(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "seed: 1\nseed: 2\n"))
    assert "duplicate key 'seed'" in message and "r.yaml:6" in message


def test_invalid_yaml_names_line(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "training: [unclosed\n"))
    assert "not valid YAML" in message and "r.yaml:" in message


def test_recipe_must_be_a_mapping(tmp_path):
    assert "mapping of sections" in error_of(write(tmp_path, "- a\n- b\n"))


def test_missing_recipe_file(tmp_path):
    assert "recipe not found" in error_of(tmp_path / "nope.yaml")


def test_set_overrides_parse_yaml_scalars(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL), ["training.max_steps=7", "training.learning_rate=1e-3",
                                                    "memory.gradient_checkpointing=true", "peft.target_modules=[q_proj]"]).recipe
    assert recipe.training.max_steps == 7 and recipe.training.learning_rate == 1e-3
    assert recipe.memory.gradient_checkpointing is True and recipe.peft.target_modules == ["q_proj"]


def test_set_error_points_at_the_override(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ["training.max_steps=-1"])
    assert "--set training.max_steps" in message


def test_set_without_equals_is_refused():
    with pytest.raises(UserError, match="KEY.PATH=VALUE"):
        apply_overrides({}, ["training.max_steps"])


def test_set_into_a_scalar_is_refused():
    with pytest.raises(UserError, match="'seed' is not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])


def test_time_limit_parses_and_rejects_garbage(tmp_path):
    assert parse_duration("11h30m") == 41400 and parse_duration("45m") == 2700 and parse_duration("90") == 90
    recipe = load_recipe(write(tmp_path, MINIMAL + "checkpoint:\n  time_limit: 1h2m3s\n")).recipe
    assert recipe.checkpoint.time_limit_s == 3723
    message = error_of(write(tmp_path, MINIMAL + "checkpoint:\n  time_limit: soon\n"))
    assert "'checkpoint.time_limit' = 'soon'" in message and "11h30m" in message


def test_time_limit_as_a_bare_number_is_seconds(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL + "checkpoint:\n  time_limit: 3600\n")).recipe
    assert recipe.checkpoint.time_limit_s == 3600
    assert "positive duration" in error_of(write(tmp_path, MINIMAL + "checkpoint:\n  time_limit: 0\n"))


def test_one_eval_source_only(tmp_path):
    message = error_of(write(tmp_path, MINIMAL.replace("train.jsonl", "train.jsonl\n  eval_rows: 5\n  eval_path: e.jsonl")))
    assert "choose one evaluation source" in message


def test_every_shipped_recipe_validates_against_the_schema():
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert len(recipes) >= 3
    for path in recipes:
        load_recipe(path)


def test_recipe_reference_doc_is_generated_from_the_schema():
    from gpupoor.scripts.docs import render_recipe_reference

    assert (ROOT / "docs" / "recipe.md").read_text() == render_recipe_reference(), \
        "docs/recipe.md is stale: run `python -m gpupoor.scripts.docs`"


def test_json_schema_lists_every_section():
    schema = Recipe.model_json_schema()
    for section in ("model", "data", "peft", "quantization", "precision", "training", "memory", "checkpoint",
                    "logging", "seed", "output_dir"):
        assert section in schema["properties"]


def test_set_of_a_whole_section_is_named_in_errors(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ["training={micro_batch_size: 0}"])
    assert "--set training" in message and "'training.micro_batch_size' = 0" in message


# ------------------------------------------------------------------------------- rules across keys, field order
def _validators_that_read_other_fields(source: str) -> list[str]:
    """Field validators in `source` that take pydantic's ValidationInfo or read `.data`: they see only the fields
    declared before their own, so reordering the fields would switch their rule off without a word."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = [d.func for d in node.decorator_list if isinstance(d, ast.Call)]
        if not any(getattr(d, "id", getattr(d, "attr", None)) == "field_validator" for d in decorators):
            continue
        takes_info = len(node.args.args) > 2
        reads_data = any(isinstance(n, ast.Attribute) and n.attr == "data" for n in ast.walk(node))
        if takes_info or reads_data:
            found.append(node.name)
    return found


def test_no_field_validator_of_the_recipe_reads_the_other_fields():
    package = ROOT / "gpupoor" / "recipe"
    found = {path.name: _validators_that_read_other_fields(path.read_text()) for path in package.glob("*.py")}
    assert not {name: where for name, where in found.items() if where}, found


def test_the_field_order_check_finds_a_validator_that_reads_info_data():
    source = """
class Recipe(BaseModel):
    @field_validator("quantization")
    @classmethod
    def _no_quantized_full_tuning(cls, value, info):
        return value if info.data.get("peft") is None else value

    @field_validator("seed")
    @classmethod
    def _fine(cls, value):
        return value
"""
    assert _validators_that_read_other_fields(source) == ["_no_quantized_full_tuning"]


RULES_ACROSS_SECTIONS = [  # (section, value) pairs that no recipe may hold together, and what the error says
    ({"peft": PeftSection(method="full")}, {"quantization": QuantizationSection(bits=4)}, "cannot be fully fine-tuned"),
    ({"training": TrainingSection(optimizer="adamw_8bit")}, {"distributed": DistributedSection(strategy="fsdp")},
     "distributed.strategy fsdp cannot step"),
]


@pytest.mark.parametrize("one, other, says", RULES_ACROSS_SECTIONS)
@pytest.mark.parametrize("reverse", [False, True])
def test_a_rule_across_sections_fires_whichever_section_comes_last(one, other, says, reverse):
    """Given in either order in the file, or set (validate_assignment) in either order: the rule fires. A field
    validator of the later-declared section reading `info.data` missed the assignment of the earlier one."""
    first, last = (other, one) if reverse else (one, other)
    base = {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}}
    dumped = {key: value.model_dump() for key, value in {**first, **last}.items()}
    with pytest.raises(ValidationError, match=says):
        Recipe.model_validate({**dumped, **base})
    with pytest.raises(ValidationError, match=says):
        Recipe.model_validate({**base, **dict(reversed(dumped.items()))})
    recipe = Recipe.model_validate(base)
    (key, value), = first.items()
    setattr(recipe, key, value)
    (key, value), = last.items()
    with pytest.raises(ValidationError, match=says):
        setattr(recipe, key, value)


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("reference", ["auto", "adapter_off", "copy"])
def test_the_schema_takes_dpo_s_reference_from_the_decision(method, reference):
    """The recipe is refused exactly where decisions.choose_reference refuses, and reference_bits is accepted
    exactly where it chooses a copy: one rule for "adapter off vs frozen copy"."""
    sections = {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl", "format": "preference"},
                "training": {"objective": "dpo"}, "peft": {"method": method}}
    try:
        chosen = choose_reference("dpo", reference, method).value
    except UserError:
        chosen = None
    for bits in (None, 4):
        preference = {"reference": reference, "reference_bits": bits}
        accepted = chosen is not None and (bits is None or chosen == "copy")
        if accepted:
            Recipe.model_validate({**sections, "preference": preference})
        else:
            with pytest.raises(ValidationError, match="preference.reference"):
                Recipe.model_validate({**sections, "preference": preference})


# ------------------------------------------------------------------------ keys added after runs were written
# Every key of the schema when ADDED marks replaced diff.py's hand list, less those marked ADDED or resume-safe.
# Frozen: a new key is marked ADDED (its value that means "as before") or RESUME_SAFE on its field, never added here,
# or every checkpoint written before it would stop matching its run's recipe hash.
ORIGINAL_KEYS = (
    "model.name_or_path", "model.revision", "model.trust_remote_code", "model.attention", "data.path", "data.format",
    "data.split", "data.text_field", "data.messages_field", "data.chat_template", "data.max_length", "data.sampler",
    "data.train_on_prompt", "data.max_rows", "data.eval_rows", "peft.method", "peft.rank", "peft.alpha",
    "peft.dropout", "peft.target_modules", "peft.modules_to_save", "quantization.bits", "quantization.quant_type",
    "quantization.double_quant", "quantization.compute_dtype", "precision", "training.micro_batch_size",
    "training.gradient_accumulation_steps", "training.learning_rate", "training.weight_decay", "training.adam_betas",
    "training.adam_eps", "training.optimizer", "training.momentum", "training.lr_scheduler", "training.warmup_steps",
    "training.warmup_ratio", "training.max_grad_norm", "memory.max_gpu_memory", "memory.fused_cross_entropy", "seed",
)


def _unmarked_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Dotted keys of `model` that are neither resume-safe, nor marked ADDED, nor ORIGINAL_KEYS."""
    unmarked = []
    for name, field in model.model_fields.items():
        key, section = f"{prefix}{name}", section_model(field.annotation)
        if is_resume_safe(field) or is_added(field):
            continue
        if section:
            unmarked += _unmarked_keys(section, f"{key}.")
        elif key not in ORIGINAL_KEYS:
            unmarked.append(key)
    return unmarked


def test_every_key_added_after_the_first_runs_is_marked_on_its_field():
    assert _unmarked_keys() == []


def test_an_unmarked_new_key_is_found():
    class NewTraining(TrainingSection):
        new_knob: int = 3

    class NewRecipe(Recipe):
        training: NewTraining = NewTraining()
        another: bool = False

    assert _unmarked_keys(NewRecipe) == ["training.new_knob", "another"]


def test_the_added_marks_are_the_hand_list_they_replaced():
    from gpupoor.recipe.schema import SHAREGPT_ROLES

    before = {"peft.last_layers": None, "distill": None, "distributed.strategy": "auto",
              "distributed.shard_frozen": True, "distributed.reshard_after_forward": True,
              "distributed.cpu_offload": False, "data.datasets": None, "data.tokenized_path": None,
              "data.conversations_field": "conversations", "peft.init_adapter": None, "training.objective": "sft",
              "preference.beta": 0.1, "preference.loss_type": "sigmoid", "preference.label_smoothing": 0.0,
              "preference.orpo_lambda": 0.1, "preference.reference": "auto", "preference.reference_bits": None,
              "model.gguf_file": None, "model.fused_layers": False, "model.kernels": "none", "model.compile": False,
              # #46: GRPO's section
              "grpo.group_size": 4, "grpo.max_new_tokens": 64, "grpo.temperature": 1.0, "grpo.top_p": 1.0,
              "grpo.beta": 0.0, "grpo.epsilon": 0.2, "grpo.epsilon_high": None, "grpo.iterations": 1,
              "grpo.loss_normalization": "token", "grpo.scale_rewards": True,
              "grpo.rewards": [{"scorer": "exact", "weight": 1.0}],
              **{f"data.sharegpt_roles.{key}": value for key, value in SHAREGPT_ROLES.items()}}
    assert ADDED_KEYS == before


def test_a_recipe_hashes_as_it_did_when_its_run_was_written(tmp_path):
    """The trajectory hash in every checkpoint's manifest: a change of its inputs breaks every resume."""
    path = write(tmp_path, MINIMAL)
    # model.fused_layers (on by default) rounds differently: with it off, a recipe hashes as before it existed.
    unfused = ["model.fused_layers=false"]
    assert trajectory_hash(load_recipe(path, unfused).recipe) == "032f2fe92f5065e4"
    assert trajectory_hash(load_recipe(path).recipe) == "881b65aaaaae22b0"
    sets = ["data.format=preference", "training.objective=dpo", "preference.beta=0.2", "peft.rank=8",
            "data.sharegpt_roles.gpt=user"]
    assert trajectory_hash(load_recipe(path, sets + unfused).recipe) == "a84f7c562419cc22"
    assert trajectory_hash(load_recipe(path, sets).recipe) == "782cb14c2f78341c"

"""The training-method table (gpupoor/method_table.py) is the one list the parts read: the schema's names and docs,
the rules, the fused-path decision. (What each method trains, as the plan counts it from the table, is checked
against peft's own models in test_plan.py.)"""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from gpupoor.decisions import choose_fused_paths
from gpupoor.method_table import METHOD_NAMES, METHODS
from gpupoor.recipe.schema import PeftSection, Recipe


def test_the_schema_offers_the_tables_methods_with_their_docs():
    field = PeftSection.model_fields["method"]
    assert get_args(field.annotation) == METHOD_NAMES
    for method in METHODS.values():
        assert f"`{method.name}`: {method.doc}" in field.description


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_the_fused_layers_run_exactly_the_methods_the_table_marks(name):
    paths = choose_fused_paths(True, "llama", name, 0.0, None, "fp32", "sdpa", "cpu")
    assert paths.mlp == METHODS[name].fused, paths.reason
    assert (f"peft.method {name}" in paths.reason) != METHODS[name].fused, paths.reason


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_dropout_is_refused_where_the_method_has_none(name):
    recipe = {"model": {"name_or_path": "x"}, "data": {"path": "x.jsonl"}, "peft": {"method": name, "dropout": 0.1}}
    method = METHODS[name]
    if method.adapter and not method.low_rank:
        with pytest.raises(ValidationError, match=f"{name} has no dropout"):
            Recipe.model_validate(recipe)
    else:
        assert Recipe.model_validate(recipe).peft.dropout == 0.1


def test_what_an_adapted_linear_trains():
    """LoRA r(in + out), DoRA one magnitude per output more, IA3 a vector over the output (the input for a
    feed-forward module), full nothing beside the weight itself."""
    assert METHODS["lora"].adapter_params(8, 64, 32) == 8 * 96
    assert METHODS["dora"].adapter_params(8, 64, 32) == 8 * 96 + 32
    assert METHODS["ia3"].adapter_params(8, 64, 32) == 32
    assert METHODS["ia3"].adapter_params(8, 64, 32, feedforward=True) == 64
    assert METHODS["full"].adapter_params(8, 64, 32) == 0 and not METHODS["full"].adapter


def test_an_adapter_config_names_its_method_and_what_merge_reads():
    """method_of_adapter reads peft_type and use_dora the way peft writes them; each mergeable method names the
    tensors AdapterWeights looks for, and merge-lora refuses the others by name."""
    from gpupoor.method_table import METHODS, method_of_adapter

    assert method_of_adapter({"peft_type": "LORA"}).name == "lora"
    assert method_of_adapter({"peft_type": "LORA", "use_dora": True}).name == "dora"
    assert method_of_adapter({"peft_type": "IA3"}).name == "ia3"
    assert method_of_adapter({"peft_type": "IA3", "use_dora": True}).name == "ia3"  # a LoraConfig key, ignored
    assert method_of_adapter({"peft_type": "LOHA"}) is None
    for method in METHODS.values():
        assert method.merges == method.adapter, method.name  # every adapter gpupoor trains can be merged today
        suffixes = dict(method.saved_tensors).values()
        assert all(s.startswith(("lora_", "ia3_")) for s in suffixes), method.name
        assert ("lora_magnitude_vector" in suffixes) == method.magnitude

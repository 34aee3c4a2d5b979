"""The unit tier of test_outputs.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

from support.outputs import TYPE_TOKEN, _type_cells


def test_recipe_reference_renders_types_as_yaml_values():
    from gpupoor.scripts.docs import render_recipe_reference
    from gpupoor.recipe.schema import Recipe

    cells = _type_cells(render_recipe_reference())
    assert "peft.target_modules" in cells and "output_dir" in cells and len(cells) > len(Recipe.model_fields)
    for key, cell in cells.items():
        assert not any(word in cell for word in ("Union", "Optional", "typing", "Literal", "None")), (key, cell)
        assert TYPE_TOKEN.sub("", cell) == "", f"{key}: unexpected text in type cell {cell!r}"
    assert cells["peft.target_modules"] == 'list[str] \\| "all-linear"'
    assert cells["quantization.bits"] == "4 \\| 8 \\| null"
    assert cells["memory.gradient_checkpointing"] == 'bool \\| "offload"'
    assert cells["model.revision"] == "str \\| null"
    assert cells["training.adam_betas"] == "tuple[float, float]"
    assert cells["data.format"] == ('"text" \\| "alpaca" \\| "chat" \\| "sharegpt" \\| "completion" \\| "tokenized" '
                                   '\\| "preference"')
    assert cells["data.datasets"] == "list[mapping] \\| null" and "data.datasets[].weight" in cells

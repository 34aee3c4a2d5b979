"""The integration tier of test_packing.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

from gpupoor.data.build import collate_packed


def test_packed_training_trains_and_reports_no_padding(make_recipe, tmp_path):
    from typer.testing import CliRunner

    from support.runs import read_metrics
    from gpupoor.cli import app

    recipe = make_recipe(data={"sampler": "packed"}, training={"max_steps": 6})
    result = CliRunner().invoke(app, ["train", str(recipe), "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    steps = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"]
    # Each step's tokens are the examples' own lengths, recomputed from the data and the batch plan (a pure
    # function of seed and epoch): filler blocks that even out the rows are not counted.
    from gpupoor.data.build import build_data, collate_packed
    from gpupoor.model.load import load_tokenizer
    from gpupoor.recipe.loading import load_recipe

    loaded = load_recipe(recipe).recipe
    tokenizer = load_tokenizer(loaded.model.name_or_path, loaded.model)
    data = build_data(loaded.data, tokenizer, micro_batch_size=loaded.training.micro_batch_size, seed=loaded.seed,
                      base_dir=tmp_path, use_cache=False, sampler="packed")
    batches = [b for epoch in range(len(steps)) for b in data.plan.epoch(epoch)][:len(steps)]
    assert [r["tokens"] for r in steps] == [sum(data.train.lengths[i] for i in b) for b in batches]
    # The check can tell: some of these micro-batches have rows of unequal length, so fillers were there.
    assert any(collate_packed(data.train, b, data.plan.row_length)["input_ids"].numel() > r["tokens"]
               for b, r in zip(batches, steps))

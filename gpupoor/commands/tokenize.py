"""`gpupoor tokenize`: a recipe's data tokenized once, with its model's tokenizer, into the directory that
data.tokenized_path trains from (gpupoor.data.tokenize writes it). Loads the tokenizer, no weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpupoor.errors import UserError


def tokenize_recipe(recipe: Path, overrides: list[str], output: Path, warn: Callable[[str], None]) -> str:
    """Write `output` from the recipe's data; the line that says what was written."""
    from gpupoor.data.build import build_data
    from gpupoor.data.tokenize import write_tokenized_dir
    from gpupoor.model.load import load_tokenizer, model_location
    from gpupoor.recipe.loading import load_recipe
    from gpupoor.storage.rundir import check_writable

    loaded = load_recipe(recipe, overrides)
    settings = loaded.recipe
    if settings.data.tokenized_path:
        raise UserError(f"{recipe}: data.tokenized_path is set, so its data is tokenized already",
                        hint="tokenize a recipe whose data.path or data.datasets names the rows")
    # Before tokenizing anything: the output is written beside itself, then renamed into place.
    check_writable(output.absolute().parent, f"--output {output}",
                   hint="give --output a directory in a writable location")
    tokenizer = load_tokenizer(model_location(settings.model, loaded.base_dir), settings.model)
    bundle = build_data(settings.data, tokenizer, micro_batch_size=settings.training.micro_batch_size,
                        seed=settings.seed, base_dir=loaded.base_dir)
    for warning in bundle.warnings:
        warn(warning)
    manifest = write_tokenized_dir(output, bundle, settings.data, tokenizer, settings.seed)
    stats = bundle.train.stats
    evaluation = f", {manifest['eval']['examples']} eval examples" if manifest["eval"] else ""
    return (f"wrote {output}: {len(bundle.train)} training examples ({stats.tokens} tokens, "
            f"{stats.truncated} truncated, {stats.dropped_no_target} dropped){evaluation}")

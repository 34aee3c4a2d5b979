"""Recipes for tests: one written for a model and a data file over sensible defaults, the shipped ones, every training
method's `peft` section."""

from __future__ import annotations

from pathlib import Path

import yaml

def shipped_recipes(real: bool = False) -> list[Path]:
    """recipes/*.yaml: those that train a tiny or built-in model, or (real=True) those that train the real model,
    a .gguf in the cache that only the `real` tier may count on (`make fetch-real`)."""
    paths = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
    assert paths, "no recipes/*.yaml found: the tests' parametrizations over them would be empty"
    return [path for path in paths
            if str(yaml.safe_load(path.read_text())["model"]["name_or_path"]).endswith(".gguf") == real]


def write_recipe(path: Path, model_dir: Path, data_file: Path, **sections) -> Path:
    """A recipe for `model_dir` on `data_file`; keyword sections are merged over sensible test defaults."""
    recipe = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"path": str(data_file), "format": "alpaca", "max_length": 128, "sampler": "random"},
        "peft": {"rank": 4},
        "training": {"micro_batch_size": 4, "max_steps": 4, "learning_rate": 1e-2, "cpu_threads": 1,
                     "warmup_steps": 0},
        "logging": {"progress": "none", "report": False},  # report.html costs ~2 s of matplotlib a run
        "seed": 0,
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict):
            recipe[key] = {**recipe[key], **value}
        else:
            recipe[key] = value
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# Every training method, and the last-N-layers variants (#14): recipe `peft` sections by name.
PEFT_METHODS = {
    "lora": {"method": "lora"},
    "dora": {"method": "dora"},
    "ia3": {"method": "ia3"},
    "full": {"method": "full"},
    "full-last-layer-and-head": {"method": "full", "last_layers": 1, "modules_to_save": ["lm_head"]},
    "lora-last-layer": {"method": "lora", "last_layers": 1},
    "dora-last-layer-and-head": {"method": "dora", "last_layers": 1, "modules_to_save": ["lm_head"]},
    "ia3-last-layer": {"method": "ia3", "last_layers": 1},
    "full-mlps-and-final-norm": {"method": "full", "modules_to_save": ["mlp", "norm"]},
}

"""The integration tier of test_tokenize.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import yaml

from support.cli import invoke

from support.tokenize import _build_reads_tokenized_dirs, mixture_recipe


@pytest.mark.skipif(not _build_reads_tokenized_dirs(), reason="build_data does not read data.tokenized_path yet")
def test_training_from_a_tokenized_directory_equals_training_from_the_rows(make_recipe, mixture_recipe, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "tokenized"
    assert invoke("tokenize", mixture_recipe, "--output", out).exit_code == 0
    raw = invoke("train", mixture_recipe, "--output-dir", tmp_path / "raw")
    assert raw.exit_code == 0, raw.output
    recipe = yaml.safe_load(mixture_recipe.read_text())
    recipe["data"] = {"tokenized_path": str(out), "format": "alpaca", "max_length": 128, "sampler": "random"}
    (tmp_path / "from-dir.yaml").write_text(yaml.safe_dump(recipe))
    tokenized = invoke("train", tmp_path / "from-dir.yaml", "--output-dir", tmp_path / "dir")
    assert tokenized.exit_code == 0, tokenized.output
    a, b = (load_file(tmp_path / run / "final" / "adapter_model.safetensors") for run in ("raw", "dir"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    flipped = bytearray((out / "train.safetensors").read_bytes())
    flipped[len(flipped) // 2] ^= 1
    (out / "train.safetensors").write_bytes(bytes(flipped))
    damaged = invoke("train", tmp_path / "from-dir.yaml", "--output-dir", tmp_path / "damaged")
    assert damaged.exit_code == 2 and "train.safetensors does not match" in damaged.output


def test_a_tokenized_directory_made_with_other_max_length_or_format_is_refused(make_recipe, tmp_path):
    # The recipe's data.max_length and data.format are not applied to tokens already cut and labelled: a recipe
    # that says otherwise is refused by validate and train, naming both values (issue #25).
    out = tmp_path / "tokenized"
    assert invoke("tokenize", make_recipe(), "--output", out).exit_code == 0  # alpaca, max_length 128
    other = make_recipe("other.yaml", data={"path": None, "tokenized_path": str(out), "max_length": 32,
                                            "format": "text"})
    for verb, extra in (("validate", []), ("train", ["--output-dir", tmp_path / "run"])):
        result = invoke(verb, other, *extra)
        assert result.exit_code == 2, result.output
        assert "data.max_length is 32 in the recipe but 128 in its manifest" in result.output
        assert "data.format is 'text' in the recipe but 'alpaca'" in result.output
        assert "data.max_length: 128 and data.format: alpaca" in result.output
    assert not (tmp_path / "run").exists()
    same = make_recipe("same.yaml", data={"path": None, "tokenized_path": str(out)})
    assert invoke("validate", same).exit_code == 0


def test_a_tokenized_path_without_a_valid_manifest_is_refused_by_validate_as_by_train(make_recipe, tmp_path):
    # validate accepted a directory with no manifest (or a damaged one) that training then refused (issue #25).
    empty = tmp_path / "empty"
    empty.mkdir()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "manifest.json").write_text("{\"kind\": \"something else\"}")
    for directory, said in ((empty, "no manifest.json"), (damaged, "is not a gpupoor tokenize manifest")):
        recipe = make_recipe(f"{directory.name}.yaml", data={"path": None, "tokenized_path": str(directory)})
        for verb, extra in (("validate", []), ("train", ["--output-dir", tmp_path / f"run-{directory.name}"])):
            result = invoke(verb, recipe, *extra)
            assert result.exit_code == 2, result.output
            assert said in result.output and "data.tokenized_path" in result.output


def test_a_run_started_before_the_settings_check_still_resumes_with_a_warning(make_recipe, tmp_path, monkeypatch):
    # Runs started before validate/train compared data.max_length and data.format with the tokenized directory's
    # (the recipe's values were ignored) must stay resumable: their data fingerprint is checked as always.
    import gpupoor.data.build
    import gpupoor.commands.validate

    out = tmp_path / "tokenized"
    assert invoke("tokenize", make_recipe(), "--output", out).exit_code == 0  # alpaca, max_length 128
    recipe = make_recipe("older.yaml", data={"path": None, "tokenized_path": str(out), "max_length": 32},
                         checkpoint={"every_steps": 2})
    with monkeypatch.context() as older:  # the gpupoor that started it did not compare them
        older.setattr(gpupoor.data.build, "check_tokenized_settings", lambda *args: None)
        older.setattr(gpupoor.commands.validate, "check_tokenized_settings", lambda *args: None)
        started = invoke("train", recipe, "--output-dir", tmp_path / "run", fault="sigterm@2", monkeypatch=monkeypatch)
        assert started.exit_code == 75, started.output
    resumed = invoke("resume", tmp_path / "run", monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, resumed.output
    assert "data.max_length is 32 in the recipe but 128 in its manifest" in resumed.output
    assert "resuming as the run started" in resumed.output

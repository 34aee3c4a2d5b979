"""A GGUF file as the base model (issue #27): validate and plan read its metadata without loading a tensor, and
each bad GGUF exits 2 naming the file and what to do. The GGUFs are written here from the tiny Llama fixture."""

from __future__ import annotations

import builtins
import shutil

import pytest

from support.cli import invoke
from support.recipes import write_recipe


@pytest.fixture()
def no_tensor_loads(monkeypatch):
    """Fail the test if anything loads a model's weights or reads a GGUF's tensors into memory."""
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    def refuse(*args, **kwargs):
        raise AssertionError("validate/plan loaded weights")

    metadata_only = gguf_utils.load_gguf_checkpoint

    def no_tensors(path, return_tensors=False, **kwargs):  # the tokenizer's loader reads the metadata alone
        if return_tensors:
            refuse()
        return metadata_only(path, return_tensors=False, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_tensors)


def test_plan_and_validate_read_the_architecture_from_the_metadata(tiny_gguf, alpaca_file, tmp_path,
                                                                    no_tensor_loads):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_gguf, alpaca_file)
    result = invoke("validate", recipe)
    assert result.exit_code == 0, result.output
    result = invoke("plan", recipe, "--json")
    assert result.exit_code == 0, result.output
    # The same plan as for the directory the GGUF was written from: the same architecture, read another way.
    from gpupoor.model.gguf import read_gguf

    facts = read_gguf(tiny_gguf)
    assert facts.config["num_hidden_layers"] == 2 and facts.config["hidden_size"] == 32
    assert facts.config["num_key_value_heads"] == 2 and facts.config["tie_word_embeddings"] is False
    assert facts.quantization == "F32" and facts.tokens == facts.config["vocab_size"] and facts.has_chat_template


def test_plan_of_gguf_matches_plan_of_its_directory(tiny_model, tiny_gguf, alpaca_file, tmp_path):
    from gpupoor.model.shape import load_shape
    from gpupoor.recipe.loading import load_recipe

    shapes = [load_shape(load_recipe(write_recipe(tmp_path / f"{i}.yaml", model, alpaca_file)))[0]
              for i, model in enumerate((tiny_model, tiny_gguf))]
    assert shapes[0].__dict__ | {"file_dtype": None} == shapes[1].__dict__ | {"file_dtype": None}


def test_directory_plus_gguf_file_names_the_same_base(tiny_gguf, alpaca_file, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_gguf.parent, alpaca_file,
                          model={"name_or_path": str(tiny_gguf.parent), "gguf_file": tiny_gguf.name})
    result = invoke("validate", recipe)
    assert result.exit_code == 0, result.output
    bad = write_recipe(tmp_path / "b.yaml", tiny_gguf, alpaca_file,
                       model={"name_or_path": str(tiny_gguf), "gguf_file": "other.gguf"})
    result = invoke("validate", bad)
    assert result.exit_code == 2 and "already names a .gguf file" in result.output, result.output


def _bad(tmp_path, alpaca_file, gguf_path, *expected):
    recipe = write_recipe(tmp_path / "r.yaml", gguf_path, alpaca_file)
    for verb in ("validate", "plan"):
        result = invoke(verb, recipe)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        for part in (str(gguf_path), *expected):
            assert part in " ".join(result.output.split()), (verb, part, result.output)


def test_a_truncated_gguf(tiny_gguf, alpaca_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 3])
    _bad(tmp_path, alpaca_file, cut, "not a readable GGUF file", "truncated", "download it again")


def test_an_architecture_transformers_cannot_load(tiny_model, alpaca_file, tmp_path):
    from gpupoor.model.tiny import write_tiny_gguf

    odd = write_tiny_gguf(tiny_model, tmp_path / "odd.gguf", architecture="rwkv9")
    _bad(tmp_path, alpaca_file, odd, "'rwkv9' model", "transformers cannot load", "llama")


def test_a_gguf_with_no_tokenizer(tiny_model, alpaca_file, tmp_path):
    from gpupoor.model.tiny import write_tiny_gguf

    bare = write_tiny_gguf(tiny_model, tmp_path / "bare.gguf", tokenizer=False)
    recipe = write_recipe(tmp_path / "r.yaml", bare, alpaca_file)
    result = invoke("validate", recipe)
    assert result.exit_code == 2 and "carries no tokenizer" in result.output and str(bare) in result.output, \
        result.output


def test_a_gguf_path_that_is_a_directory(alpaca_file, tmp_path):
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    _bad(tmp_path, alpaca_file, folder, "is a directory, not a GGUF file", "model.gguf_file")


def test_gguf_package_missing(tiny_gguf, alpaca_file, tmp_path, monkeypatch):
    import gpupoor.model.gguf as gguf_rules

    gguf_rules._read.cache_clear()
    real_import = builtins.__import__

    def no_gguf(name, *args, **kwargs):
        if name == "gguf":
            raise ImportError("No module named 'gguf'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_gguf, copy)
    _bad(tmp_path, alpaca_file, copy, "needs the gguf package", "pip install gguf", "pip install -e '.[gguf]'")


def test_model_identity_is_the_gguf_file(tiny_gguf, tmp_path):
    from types import SimpleNamespace

    import gpupoor.model.identity as identity

    copy = tmp_path / "base.gguf"
    shutil.copy(tiny_gguf, copy)
    recipe = SimpleNamespace(model=SimpleNamespace(name_or_path=str(copy), revision=None, gguf_file=None),
                             distill=None)
    first = identity.model_identities(recipe)
    assert list(first["model.name_or_path"]["files"]) == ["base.gguf"]
    assert first["model.name_or_path"]["config"] == {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32}
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1  # one weight's byte changed in place
    copy.write_bytes(bytes(data))
    assert identity.model_changes(first, identity.model_identities(recipe, first)) == {
        "model.name_or_path": f"{copy}: base.gguf changed"}


def test_validate_show_renders_rows_with_the_gguf_tokenizer(tiny_gguf, alpaca_file, tmp_path, no_tensor_loads):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_gguf, alpaca_file)
    result = invoke("validate", recipe, "--show", "1")
    assert result.exit_code == 0 and "trained" in result.output and "Traceback" not in result.output, result.output


def test_a_gguf_teacher_is_planned_from_its_metadata(tiny_gguf, tiny_model, alpaca_file, tmp_path, no_tensor_loads):
    from gpupoor.model.shape import load_teacher_shape
    from gpupoor.recipe.loading import load_recipe

    recipe = write_recipe(tmp_path / "r.yaml", tiny_model, alpaca_file, distill={"teacher": str(tiny_gguf)})
    shape, source = load_teacher_shape(load_recipe(recipe))
    assert source == str(tiny_gguf) and shape.layers == 2 and shape.hidden == 32
    assert invoke("validate", recipe).exit_code == 0

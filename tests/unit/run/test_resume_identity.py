"""The unit tier of test_resume.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import shutil


def test_model_identity_reuses_hashes_of_unchanged_files_and_names_hub_commits(tiny_model, tmp_path, monkeypatch):
    from types import SimpleNamespace

    import huggingface_hub

    import gpupoor.model.identity as identity

    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    recipe = SimpleNamespace(model=SimpleNamespace(name_or_path=str(base), revision=None),
                             distill=SimpleNamespace(teacher="owner/teacher", revision=None))
    first = identity.model_identities(recipe)
    assert sorted(first["model.name_or_path"]["files"]) == ["config.json", "model.safetensors"]
    assert first["distill.teacher"] == {"hub": "owner/teacher", "commit": None, "config": None}  # not cached
    assert first["model.name_or_path"]["config"] == {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32}
    hashed = []
    monkeypatch.setattr(identity, "sha256_file", lambda path: hashed.append(path.name) or "rehashed")
    (tmp_path / "cache" / identity.CACHE_FILE).unlink()  # from the previous checkpoint's record alone
    assert identity.model_identities(recipe, first) == first and hashed == []
    assert identity.model_identities(recipe) == first and hashed == []  # from the cache file
    (base / "model.safetensors").write_bytes((base / "model.safetensors").read_bytes())  # rewritten: hashed again
    again = identity.model_identities(recipe, first)
    assert hashed == ["model.safetensors"]
    assert identity.model_changes(first, again) == {"model.name_or_path": f"{base}: model.safetensors changed"}
    # A hub model is the commit its cached snapshot resolves to; an unknown commit is never a change.
    hub = tmp_path / "hub"
    for commit in ("a" * 40, "b" * 40):
        (hub / "models--owner--teacher" / "snapshots" / commit).mkdir(parents=True)
        (hub / "models--owner--teacher" / "snapshots" / commit / "config.json").write_text("{}")
    (hub / "models--owner--teacher" / "refs").mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    (hub / "models--owner--teacher" / "refs" / "main").write_text("a" * 40)
    before = identity.model_identities(recipe)
    assert before["distill.teacher"]["commit"] == "a" * 40
    assert identity.model_changes({"distill.teacher": first["distill.teacher"]}, before) == {}
    (hub / "models--owner--teacher" / "refs" / "main").write_text("b" * 40)
    assert identity.model_changes(before, identity.model_identities(recipe)) == \
        {"distill.teacher": f"hub owner/teacher: commit {'a' * 40} -> {'b' * 40}"}

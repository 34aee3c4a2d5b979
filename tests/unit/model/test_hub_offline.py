"""With no network, a hub id fails at once in one line (not ten retry lines over ~50 s), and a cached one loads
from the cache without asking the hub."""

from __future__ import annotations

import time

import pytest

from gpupoor.errors import UserError


@pytest.fixture()
def no_hub(tmp_path, monkeypatch):
    """A hub host that does not resolve (.invalid is reserved for that), an empty hub cache, offline mode off."""
    import huggingface_hub.constants as constants

    from gpupoor.model import hub

    monkeypatch.setattr(constants, "ENDPOINT", "https://gpupoor-test-hub.invalid")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # recorded, so the variable the code sets is undone after
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.hub_reachable.cache_clear()
    monkeypatch.setattr(hub, "_went_offline", False)
    yield tmp_path / "hub"
    hub.hub_reachable.cache_clear()


def test_an_uncached_hub_id_fails_at_once_saying_why(no_hub):
    from gpupoor.model.load import load_tokenizer
    from gpupoor.recipe.schema import ModelSection

    started = time.monotonic()
    with pytest.raises(UserError) as caught:
        load_tokenizer("someone/some-model", ModelSection(name_or_path="someone/some-model"))
    assert time.monotonic() - started < 10  # huggingface_hub's own retries take ~50 s
    message = str(caught.value)
    assert "model.name_or_path: 'someone/some-model' is a hub id, it is not in this machine's hub cache" in message
    assert "gpupoor-test-hub.invalid cannot be reached" in message and "hf download someone/some-model" in message


def test_a_cached_hub_id_is_read_from_the_cache_offline(no_hub):
    import huggingface_hub.constants as constants

    from gpupoor.model.hub import require_hub_model

    snapshot = no_hub / "models--someone--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (no_hub / "models--someone--cached" / "refs").mkdir()
    (no_hub / "models--someone--cached" / "refs" / "main").write_text("abc123")
    require_hub_model("someone/cached", "model.name_or_path")  # no error
    assert constants.HF_HUB_OFFLINE is True  # the rest of the process reads the cache, with no retries


def test_the_memory_plan_says_the_hub_cannot_be_reached_not_that_the_user_went_offline(no_hub, tmp_path):
    from gpupoor.model.shape import find_config

    with pytest.raises(UserError) as caught:
        find_config("someone/not-bundled", tmp_path)
    assert "gpupoor-test-hub.invalid cannot be reached from here (no network)" in str(caught.value)
    assert "unset HF_HUB_OFFLINE" not in str(caught.value)


def test_a_users_own_offline_setting_is_named_as_the_cause(no_hub, monkeypatch):
    from gpupoor.model.hub import require_hub_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as caught:
        require_hub_model("someone/some-model", "model.name_or_path")
    assert "and HF_HUB_OFFLINE=1 is set" in str(caught.value)

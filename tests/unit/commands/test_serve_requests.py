"""`gpupoor serve`'s request checks (gpupoor/commands/serve_requests.py) without a server: max_tokens capped at the
context the prompt leaves (the contract test's long answers also meet the time limit, so the cap is shown here)."""

from __future__ import annotations

import pytest

from gpupoor.commands.serve_requests import Refused, ServedModel, _max_tokens


def served(context: int | None, configured: int = 0) -> ServedModel:
    return ServedModel(name="run", path="/tmp/merged", context=context,
                       generation_config={"max_new_tokens": configured} if configured else {}, time_limit_s=60,
                       count_chat=lambda messages: 0, count_text=lambda text: 0, vocab_size=100)


def test_max_tokens_is_capped_at_the_room_the_prompt_leaves():
    assert _max_tokens({"max_tokens": 3}, "completion", 8, "prompt", served(10)) == 2
    assert _max_tokens({"max_tokens": 10**9}, "completion", 8, "prompt", served(10)) == 2
    assert _max_tokens({"max_tokens": 1}, "completion", 8, "prompt", served(10)) == 1
    assert _max_tokens({}, "chat", 4, "messages", served(1000)) == 996  # the default (1024) capped too
    assert _max_tokens({"max_completion_tokens": 5, "max_tokens": 50}, "chat", 4, "messages", served(1000)) == 5
    assert _max_tokens({"max_tokens": 50}, "completion", 4, "prompt", served(None)) == 50  # no context known


@pytest.mark.parametrize("body, prompt, code, param", [
    ({"max_tokens": 5}, 10, "context_length_exceeded", "prompt"),  # the prompt fills the context
    ({"max_tokens": 5}, 12, "context_length_exceeded", "prompt"),
    ({"max_tokens": 0}, 2, "invalid_value", "max_tokens"),
    ({"max_tokens": 2.5}, 2, "invalid_value", "max_tokens"),
    ({"max_tokens": "9"}, 2, "invalid_value", "max_tokens"),
])
def test_a_prompt_without_room_or_a_bad_max_tokens_is_refused(body, prompt, code, param):
    with pytest.raises(Refused) as info:
        _max_tokens(body, "completion", prompt, "prompt", served(10))
    assert (info.value.code, info.value.param, info.value.status) == (code, param, 400)

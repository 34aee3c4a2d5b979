"""Shared by the bad_input tests (moved from unit/test_bad_input.py, whose tests still use them)."""

from __future__ import annotations

import json

from typer.testing import CliRunner


runner = CliRunner()


USER = {"role": "user", "content": "sort lists"}


ASSISTANT = {"role": "assistant", "content": "done"}


# A lone UTF-16 surrogate escape: valid JSON, no character; a tokenizer cannot encode it (a TypeError naming no
# row before). Each format: a good row, then one whose FIELD holds "\ud800" (json.dumps writes it escaped).
LONE = "x\ud800y"


SURROGATE_ROWS = {  # format -> (good row, bad row, the field named, extra data settings, training settings)
    "text": ({"text": "sort lists"}, {"text": LONE}, "text", {}, {}),
    "alpaca": ({"instruction": "sort", "output": "done"}, {"instruction": "sort", "output": LONE}, "output", {}, {}),
    "completion": ({"prompt": "sort", "completion": "done"}, {"prompt": LONE, "completion": "done"}, "prompt", {},
                   {}),
    "chat": ({"messages": [USER, ASSISTANT]}, {"messages": [USER, {"role": "assistant", "content": LONE}]},
             "messages[1].content", {"chat_template": "chatml"}, {}),
    "sharegpt": ({"conversations": [{"from": "human", "value": "sort"}, {"from": "gpt", "value": "done"}]},
                 {"conversations": [{"from": "human", "value": LONE}, {"from": "gpt", "value": "done"}]},
                 "conversations[0].value", {"chat_template": "chatml"}, {}),
    "preference": ({"prompt": "sort", "chosen": "done", "rejected": "no"},
                   {"prompt": "sort", "chosen": "done", "rejected": LONE}, "rejected", {}, {"objective": "dpo"}),
}


def surrogate_recipe(make_recipe, tmp_path, fmt: str, suffix: str = ".jsonl"):
    good, bad, _, data, training = SURROGATE_ROWS[fmt]
    path = tmp_path / f"lone{suffix}"
    if suffix == ".jsonl":
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    else:
        path.write_text("[\n" + json.dumps(good) + ",\n" + json.dumps(bad) + "\n]\n")
    assert "\\ud800" in path.read_text()
    return make_recipe(data={"path": str(path), "format": fmt, **data}, training=training)

"""Settings that would change nothing, or something else, without a word: validate (and train's preflight) say
so; rows of another format than the recipe's get the format their fields are."""

from __future__ import annotations

import yaml

from support.cli import invoke
from support.rows import alpaca_rows, write_jsonl


def recipe(tmp_path, rows, **sections) -> str:
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    body = {"model": {"name_or_path": "gpupoor:demo"}, "data": {"path": str(data)}}
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(body))
    return tmp_path / "r.yaml"


def test_alpaca_rows_under_the_default_text_format_are_told_their_format(tmp_path):
    result = invoke("validate", recipe(tmp_path, alpaca_rows(4)))
    assert result.exit_code == 2
    assert "missing field 'text'" in result.output and "its fields are those of format alpaca: set data.format: " \
        "alpaca" in result.output


def test_a_chat_template_the_format_does_not_use_is_said(tmp_path):
    result = invoke("validate", recipe(tmp_path, alpaca_rows(4), data={"format": "alpaca", "chat_template": "chatml"}))
    assert result.exit_code == 0, result.output
    assert "data.chat_template (chatml) is unused: format alpaca renders no chat template" in result.output
    quiet = invoke("validate", recipe(tmp_path, alpaca_rows(4), data={"format": "alpaca"}))
    assert quiet.exit_code == 0 and "unused" not in quiet.output


def test_remote_model_code_turning_packing_off_is_said(tmp_path):
    said = invoke("validate", recipe(tmp_path, alpaca_rows(4), data={"format": "alpaca"},
                                     model={"trust_remote_code": True}))
    assert said.exit_code == 0, said.output
    assert "model.trust_remote_code: true turns packing off: data.sampler auto is length_grouped" in said.output
    chosen = invoke("validate", recipe(tmp_path, alpaca_rows(4), data={"format": "alpaca", "sampler": "packed"},
                                       model={"trust_remote_code": True}))
    assert chosen.exit_code == 0 and "turns packing off" not in chosen.output  # asked for: nothing to tell

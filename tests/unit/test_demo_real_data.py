"""The real-model demo's shipped data (recipes/data/iso-dates-*.jsonl) and its judge's reading of it; no model."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from gpupoor.commands.demo_real import read_eval_rows

DATA = Path(__file__).resolve().parents[2] / "recipes" / "data"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_iso_dates", DATA / "make_iso_dates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_files_are_what_the_generator_writes(tmp_path):
    load_generator().main(["--out-dir", str(tmp_path)])
    for name in ("iso-dates-train.jsonl", "iso-dates-eval.jsonl", "iso-dates-pairs.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"rerun recipes/data/make_iso_dates.py"


def test_eval_rows_are_held_out_and_answers_are_iso_dates():
    train = {json.loads(line)["messages"][0]["content"] for line in (DATA / "iso-dates-train.jsonl").open()}
    rows = read_eval_rows(DATA / "iso-dates-eval.jsonl")
    assert len(rows) == 50 and not {prompt[-1]["content"] for prompt, _ in rows} & train
    assert all(len(answer) == 10 and answer[4] == answer[7] == "-" for _, answer in rows)
    # the no-collapse question asks for France's capital: no training row may teach it
    assert not any("France" in question for question in train)


def test_preference_pairs_prefer_the_iso_answer_on_new_questions():
    seen = {json.loads(line)["messages"][0]["content"]
            for name in ("iso-dates-train.jsonl", "iso-dates-eval.jsonl") for line in (DATA / name).open()}
    pairs = [json.loads(line) for line in (DATA / "iso-dates-pairs.jsonl").open()]
    assert len(pairs) == 12 and not {pair["prompt"][0]["content"] for pair in pairs} & seen
    for pair in pairs:
        chosen, rejected = pair["chosen"][0]["content"], pair["rejected"][0]["content"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", chosen) and rejected != chosen
        assert chosen[:4] in pair["prompt"][0]["content"]  # the year the sentence names


@pytest.mark.parametrize("line", ['{"messages": [{"role": "user", "content": "hi"}]}', "not json", "{}"])
def test_a_row_without_an_answer_is_bad_input(tmp_path, line, capsys):
    path = tmp_path / "eval.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(SystemExit) as raised:
        read_eval_rows(path)
    assert raised.value.code == 2 and f"{path}:1" in capsys.readouterr().err

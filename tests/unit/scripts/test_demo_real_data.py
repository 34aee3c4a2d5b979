"""The real-model demo's shipped data (recipes/data/iso-dates-*.jsonl) and its judge (gpupoor.scripts.demo_real):
how it reads the rows, the table it prints and its verdict and exit code, with the model's answers made up here (no
model; tests/real/test_demo_real.py runs the judge on the real one)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from gpupoor.scripts import demo_real
from gpupoor.scripts.demo_real import Scores, read_eval_rows, verdict

DATA = Path(__file__).resolve().parents[3] / "recipes" / "data"


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
    train = {json.loads(line)["messages"][0]["content"]
             for line in (DATA / "iso-dates-train.jsonl").read_text().splitlines()}
    rows = read_eval_rows(DATA / "iso-dates-eval.jsonl")
    assert len(rows) == 50 and not {prompt[-1]["content"] for prompt, _ in rows} & train
    assert all(len(answer) == 10 and answer[4] == answer[7] == "-" for _, answer in rows)
    # the no-collapse question asks for France's capital: no training row may teach it
    assert not any("France" in question for question in train)


def test_preference_pairs_prefer_the_iso_answer_on_new_questions():
    seen = {json.loads(line)["messages"][0]["content"]
            for name in ("iso-dates-train.jsonl", "iso-dates-eval.jsonl")
            for line in (DATA / name).read_text().splitlines()}
    pairs = [json.loads(line) for line in (DATA / "iso-dates-pairs.jsonl").read_text().splitlines()]
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


KEPT = ["The capital of France is Paris.", "The opposite of hot is cold."]


def made_up(rows, exact: int, general=KEPT) -> Scores:
    """Scores whose first `exact` answers are right and the rest a sentence, as the base model answers."""
    answers = [expected if i < exact else "The date is in March." for i, (_, expected) in enumerate(rows)]
    return Scores(exact, len(rows), answers, list(general), 1.0)


@pytest.fixture()
def rows():
    return read_eval_rows(DATA / "iso-dates-eval.jsonl")[:16]


def test_verdict_passes_a_large_gain_that_kept_the_general_answers(rows):
    assert verdict(made_up(rows, 0), made_up(rows, 15), min_after=0.8, min_gain=0.5) == []


def test_verdict_names_each_failure(rows):
    # high after training but the base was nearly there already: no gain to show
    [reason] = verdict(made_up(rows, 12), made_up(rows, 14), min_after=0.8, min_gain=0.5)
    assert "gain is +12%" in reason and "12/16 -> 14/16" in reason and "--min-gain" in reason
    # a gain, but under the bar
    [reason] = verdict(made_up(rows, 0), made_up(rows, 9), min_after=0.8, min_gain=0.5)
    assert "9/16 (56%)" in reason and "--min-after" in reason
    # learned the task and forgot everything else
    [reason] = verdict(made_up(rows, 0), made_up(rows, 16, [KEPT[0], "1999"]), min_after=0.8, min_gain=0.5)
    assert "What is the opposite of hot?" in reason and "'1999'" in reason and "collapse" in reason


def test_the_table_shows_both_scores_on_one_line_and_marks_each_answer(rows, capsys):
    demo_real.print_table(rows, made_up(rows, 0), made_up(rows, 15, [KEPT[0], "1999"]), examples=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["before", "(base)", "after", "(+", "adapter)"]
    assert lines[2].split() == ["held-out", "exact", "match", "(16", "rows)", "0/16", "(0%)", "15/16", "(94%)"]
    assert lines[3].split() == ["general", "questions", "still", "answered", "2/2", "1/2"]
    assert f"    {rows[0][1]}  x 'The date is in March.'  = '{rows[0][1]}'" in lines


class FakeAdapter:
    """PeftModel.from_pretrained's stand-in: what main() calls on the model with its adapter."""

    def __init__(self):
        self.adapter_on = True

    def eval(self):
        return self

    def disable_adapter(self):
        import contextlib

        @contextlib.contextmanager
        def off():
            self.adapter_on = False
            yield
            self.adapter_on = True
        return off()


def judge(monkeypatch, tmp_path, before: int, after: int, *args: str) -> int:
    """main() on the shipped eval rows, with made-up scores in place of a model's answers."""
    import peft

    adapter = tmp_path / "final"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    model = FakeAdapter()
    monkeypatch.setattr(demo_real, "load_base", lambda base: (object(), None))
    monkeypatch.setattr(peft.PeftModel, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(demo_real, "score", lambda m, t, rows, label="": made_up(rows, after if m.adapter_on else before))
    return demo_real.main(["--base", str(tmp_path), "--eval", str(DATA / "iso-dates-eval.jsonl"),
                           "--adapter", str(adapter), *args])


def test_the_judge_passes_a_gain_and_fails_when_it_is_not_there(monkeypatch, tmp_path, capsys):
    assert judge(monkeypatch, tmp_path / "a", 0, 49) == 0
    out = capsys.readouterr().out
    assert "0/50 (0%)" in out and "49/50 (98%)" in out
    assert out.splitlines()[-1] == "PASS: held-out exact match 0/50 -> 49/50 (+98%), and both general questions " \
        "still answered"
    assert judge(monkeypatch, tmp_path / "b", 2, 20) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("FAIL: the exact match after training is 20/50 (40%)")


def test_limit_scores_the_first_rows_only(monkeypatch, tmp_path, capsys):
    assert judge(monkeypatch, tmp_path, 0, 8, "--limit", "8") == 0
    out = capsys.readouterr().out
    assert "held-out exact match (8 rows)" in out and "0/8 (0%)" in out and "8/8 (100%)" in out


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_a_limit_under_one_is_bad_input(limit, capsys):
    assert demo_real.main(["--base", "unused", "--limit", limit]) == 2
    assert f"--limit {limit}: must be at least 1" in capsys.readouterr().err


def test_grpo_demo_prompts_are_what_their_generator_writes_and_held_out():
    spec = importlib.util.spec_from_file_location("make_grpo_dates", DATA / "make_grpo_dates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    made = "".join(json.dumps(row) + "\n" for row in module.rows())
    assert made == (DATA / "grpo-train.jsonl").read_text() + (DATA / "grpo-eval.jsonl").read_text(), \
        "rerun recipes/data/make_grpo_dates.py"
    question = [json.loads(line)["messages"][2]["content"] for line in made.splitlines()]
    assert len(set(question[:300]) & set(question[300:])) == 0 and len(question) == 350

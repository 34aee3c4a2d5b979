"""`gpupoor eval`: both models on held-out rows in the run's format, scored, with their eval loss."""

from __future__ import annotations

import json

import pytest

from support.cli import invoke
from support.rows import alpaca_rows, write_jsonl
from support.merge import train_run


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model):
    return train_run(tmp_path_factory.mktemp("eval"), tiny_model, "lora")


def test_eval_scores_the_base_and_the_tuned_model_on_the_runs_rows(run, tmp_path, monkeypatch):
    """On the rows it trained on, the adapter's loss is below the base's (the same weights with the adapter off);
    each metric's count agrees with the answers in the JSON; a user's metric function is called per row."""
    (tmp_path / "my_metric.py").write_text("def short(answer, expected, row):\n    return len(answer) < 20\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = run.parent / "lora.jsonl"  # the run's training rows
    result = invoke("eval", run, "--data", data, "--metric", "exact", "--metric", "contains", "--metric",
                    "my_metric:short", "--limit", "8", "--max-new-tokens", "8", "--general")
    assert result.exit_code == 0, result.output
    report = json.loads((run / "eval" / "lora.json").read_text())
    base, tuned = report["columns"]
    assert (base["name"], tuned["name"], report["rows"]) == ("base", "tuned", 8)
    assert tuned["eval_loss"] < base["eval_loss"]
    for column in (base, tuned):
        answers = [example[column["name"]] for example in report["examples"]]
        expected = [example["expected"] for example in report["examples"]]
        assert column["scores"]["exact"] == [float(a == e.strip()) for a, e in zip(answers, expected)]
        assert column["scores"]["my_metric:short"] == [float(len(a) < 20) for a in answers]
        assert len(column["general"]) == 2
        # each of the 8 answers generated 1 to 8 tokens (--max-new-tokens 8), in a measured time
        assert 8 <= column["answer_tokens"] <= 64 and column["answer_seconds"] > 0
    assert "eval loss" in result.output and "general questions kept" in result.output
    rate = next(line for line in result.output.splitlines() if line.startswith("answer tokens/s")).split()[-2:]
    assert [round(float(value), 1) for value in rate] == [
        round(c["answer_tokens"] / c["answer_seconds"], 1) for c in (base, tuned)]


def test_eval_refuses_what_it_cannot_score(run, tmp_path, monkeypatch):
    text_rows = write_jsonl(tmp_path / "text.jsonl", [{"text": "no answer here"}])
    result = invoke("eval", run, "--data", text_rows)  # the run is alpaca: the row lacks its fields
    assert result.exit_code == 2 and "text.jsonl:1" in result.output
    rows = write_jsonl(tmp_path / "rows.jsonl", alpaca_rows(2))
    result = invoke("eval", run, "--data", rows, "--metric", "bleu")
    assert result.exit_code == 2 and "--metric 'bleu'" in result.output and "regex:PATTERN" in result.output
    result = invoke("eval", run, "--data", rows, "--metric", "regex:([")
    assert result.exit_code == 2 and "not a regular expression" in result.output
    # a row without its answer is found from the run's recipe, before the model loads (it was found after)
    import gpupoor.model.generation

    loaded = []
    original = gpupoor.model.generation.load_generator
    monkeypatch.setattr(gpupoor.model.generation, "load_generator",
                        lambda *a, **k: loaded.append(1) or original(*a, **k))
    unanswered = write_jsonl(tmp_path / "unanswered.jsonl", [{"instruction": "sort", "output": "ok"},
                                                              {"instruction": "sort"}])
    result = invoke("eval", run, "--data", unanswered)
    assert result.exit_code == 2 and "unanswered.jsonl:2" in result.output and loaded == [], result.output


def test_eval_runs_an_lm_evaluation_harness_task_of_local_data(run, tmp_path, monkeypatch, capfd):
    """--tasks with a task YAML of one's own (local data: no network): the harness scores the base and the tuned
    model, the same loaded weights with the adapter off and on; on the rows it trained on, the tuned model's
    perplexity of the answers is the lower. Run outside a git repository, nothing of git's reaches the terminal
    (the harness asks git for a commit hash)."""
    pytest.importorskip("lm_eval")
    import yaml

    from gpupoor.data.row_formats import alpaca_prompt

    monkeypatch.chdir(tmp_path)
    trained = [json.loads(line) for line in (run.parent / "lora.jsonl").read_text().splitlines()][:6]
    rows = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": alpaca_prompt(r["instruction"], r.get("input", "")),
                                                "answer": r["output"]} for r in trained])
    task = {"task": "gpupoor_test_qa", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(rows)}},
            "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}", "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]}
    (tmp_path / "qa.yaml").write_text(yaml.safe_dump(task))
    result = invoke("eval", run, "--tasks", tmp_path / "qa.yaml", "--output", tmp_path / "tasks.json")
    assert result.exit_code == 0, result.output
    assert "not a git repository" not in result.output + capfd.readouterr().err
    tasks = json.loads((tmp_path / "tasks.json").read_text())["tasks"]
    base, tuned = tasks["base"]["gpupoor_test_qa"], tasks["tuned"]["gpupoor_test_qa"]
    assert tuned["perplexity"] < base["perplexity"]
    assert "gpupoor_test_qa / perplexity" in result.output
    unknown = invoke("eval", run, "--tasks", "no_such_task_anywhere")
    assert unknown.exit_code == 2 and "not a task lm-evaluation-harness knows" in unknown.output
    nothing = invoke("eval", run)
    assert nothing.exit_code == 2 and "nothing to evaluate on" in nothing.output


def test_a_task_the_harness_cannot_read_is_refused_before_the_model_loads(run, tmp_path, monkeypatch):
    """A task YAML whose data the harness cannot parse: exit 2 naming the file and what the harness said (before,
    exit 1 `DatasetGenerationError` after the model had loaded)."""
    pytest.importorskip("lm_eval")
    import yaml

    import gpupoor.model.generation

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(gpupoor.model.generation, "load_generator", refuse)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": "b"}\n{"prompt": oops\n')
    task = tmp_path / "broken.yaml"
    task.write_text(yaml.safe_dump({
        "task": "gpupoor_test_broken", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "broken.jsonl")}}, "test_split": "test",
        "output_type": "loglikelihood", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}"}))
    result = invoke("eval", run, "--tasks", task)
    assert result.exit_code == 2, result.output
    assert f"--tasks {task}: lm-evaluation-harness cannot read this task (DatasetGenerationError" in result.output
    assert "JSON parse error" in result.output and "fix the task YAML or the data it names" in result.output


def test_pass_if_sets_the_exit_code_from_the_tuned_models_scores(run, tmp_path):
    data = run.parent / "lora.jsonl"
    common = ["eval", run, "--data", data, "--limit", "4", "--max-new-tokens", "4", "--output", tmp_path / "e.json"]
    passed = invoke(*common, "--pass-if", "exact>=0", "--pass-if", "exact-gain>=-1")
    assert passed.exit_code == 0 and "PASS: exact>=0, exact-gain>=-1" in passed.output, passed.output
    failed = invoke(*common, "--pass-if", "exact>=1")
    assert failed.exit_code == 1 and "FAIL: exact>=1: it reached" in failed.output, failed.output
    verdict = json.loads((tmp_path / "e.json").read_text())["verdict"]
    assert verdict["passed"] is False and verdict["pass_if"] == ["exact>=1"]
    for spec, said in (("exact>0.5", "--pass-if takes >= only"), ("contains>=0.5", "contains is not among the metrics"),
                       ("general>=2", "add --general"), ("exact>=1.5", "from 0 to 1")):
        refused = invoke(*common, "--pass-if", spec)
        assert refused.exit_code == 2 and said in refused.output, (spec, refused.output)

"""GRPO as a recipe objective end to end on the tiny model: it trains, logs its rewards and samples, evaluates
greedy answers, resumes to the same answers and weights, and refuses what it cannot do with the key named."""

from __future__ import annotations

import json

import pytest

from support.cli import invoke
from support.runs import assert_same_run, read_metrics

# The tiny random model's answers are a few random byte-level tokens: their length in characters varies, so a
# length reward differs within a group (GRPO learns nothing from a group of equal rewards).
GRPO = {"group_size": 4, "max_new_tokens": 6, "rewards": [{"scorer": "length<=8"}, {"scorer": "exact", "weight": 2}]}


def grpo_recipe(make_recipe, name: str = "grpo.yaml", grpo: dict | None = None, **sections):
    training = {"objective": "grpo", "micro_batch_size": 2, "max_steps": 3, **sections.pop("training", {})}
    return make_recipe(name, training=training, grpo={**GRPO, **(grpo or {})}, **sections)


def steps(run) -> list[dict]:
    return [r for r in read_metrics(run) if "loss" in r]


def test_grpo_trains_and_logs_rewards_kl_and_samples(make_recipe, tmp_path):
    recipe = grpo_recipe(make_recipe, grpo={"beta": 0.04})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "GRPO: 4 answers per prompt of up to 6 tokens" in result.output
    assert "log-probabilities chunked through the fused head" in result.output
    records = steps(tmp_path / "run")
    assert len(records) == 3
    for record in records:
        assert record["reward"] == pytest.approx(record["reward_length_8"] + 2 * record["reward_exact"])
        assert 1 <= record["answer_tokens"] <= 6 and 0 <= record["clip_fraction"] <= 1
    assert any(r["reward_std"] > 0 for r in records)  # something to learn from
    assert records[0]["kl"] == 0.0  # the adapter starts as the identity: the policy is its reference
    assert records[-1]["kl"] > 0.0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 2, 3]
    first = samples[0]
    assert first["prompt"].endswith("### Response:\n") and first["expected"]
    assert len(first["answers"]) == 4 and {"text", "reward", "reward_exact", "reward_length_8"} <= set(first["answers"][0])
    for answer in first["answers"]:  # each answer's reward is its scores' weighted sum
        assert answer["reward"] == pytest.approx(answer["reward_length_8"] + 2 * answer["reward_exact"])


def test_grpo_evaluates_greedy_answers(make_recipe, tmp_path):
    """eval_loss is minus the mean reward of greedy answers (lower is better, as everywhere); eval_accuracy the
    share equal to the row's answer; each reward's mean beside them."""
    recipe = grpo_recipe(make_recipe, data={"eval_rows": 6}, training={"eval_every_steps": 2, "max_steps": 2})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    evals = [r for r in read_metrics(tmp_path / "run") if "eval_loss" in r]
    assert evals and all(e["eval_loss"] == pytest.approx(-e["eval_reward"]) for e in evals)
    assert all(e["eval_reward"] == pytest.approx(e["eval_reward_length_8"] + 2 * e["eval_reward_exact"])
               for e in evals)
    assert all(0 <= e["eval_accuracy"] <= 1 and 1 <= e["eval_answer_tokens"] <= 6 for e in evals)
    assert "eval_kl" not in evals[0]  # measured on the training answers only


@pytest.mark.parametrize("iterations, stop", [(1, 3), (2, 3), (2, 4)])
def test_grpo_resumes_to_the_same_answers_and_weights(make_recipe, tmp_path, monkeypatch, iterations, stop):
    """Stopped after step `stop` and resumed: the same rewards, losses and adapter, bitwise. With 2 iterations
    step 3 ends mid-window (its answers were sampled at step 3 and serve step 4 too: kept in the checkpoint)."""
    grpo = {"iterations": iterations, "beta": 0.04}
    recipe = grpo_recipe(make_recipe, grpo=grpo, training={"max_steps": 6})
    straight = tmp_path / "straight"
    assert invoke("train", recipe, "--output-dir", straight, monkeypatch=monkeypatch).exit_code == 0
    run = tmp_path / "stopped"
    result = invoke("train", recipe, "--output-dir", run, fault=f"sigterm@{stop}", monkeypatch=monkeypatch)
    assert result.exit_code == 75, result.output
    state = json.loads((run / "checkpoints" / f"step-{stop:06d}" / "train_state.json").read_text())
    assert len(state["rollout"]) == (1 if iterations == 2 else 0)
    result = invoke("resume", run, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    assert_same_run(straight, run)
    for key in ("reward", "reward_std", "kl", "clip_fraction", "answer_tokens"):
        assert [r[key] for r in steps(straight)] == [r[key] for r in steps(run)], key
    if iterations == 2:  # the second update of each sampling moved the policy off the sampler: clipping is live
        assert [r["reward"] for r in steps(run)][::2] == [r["reward"] for r in steps(run)][1::2]


def test_grpo_refusals_name_the_key(make_recipe, tmp_path):
    cases = [({"data": {"format": "text"}}, "training.objective grpo samples answers to the data's prompts"),
             ({"data": {"sampler": "packed"}}, "data.sampler packed does not apply to training.objective grpo"),
             ({"peft": {"method": "full"}, "grpo": {"beta": 0.1}}, "grpo.beta > 0 needs a reference"),
             ({"grpo": {"rewards": [{"scorer": "exactly"}]}}, "'exactly' is not a scorer gpupoor knows"),
             ({"grpo": {"rewards": [{"scorer": "exact"}, {"scorer": "exact", "weight": 2}]}},
              "exact listed more than once"),
             ({"grpo": {"epsilon": 0.3, "epsilon_high": 0.2}}, "grpo.epsilon_high 0.2 is below grpo.epsilon 0.3"),
             # every advantage would be 0 by construction: it trained to the end and changed nothing
             ({"grpo": {"rewards": [{"scorer": "exact", "weight": 0}, {"scorer": "json", "weight": 0.0}]}},
              "every reward's weight is 0"),
             ({"grpo": {"rewards": [{"scorer": "exact", "weight": float("nan")}]}}, "grpo.rewards.0.weight"),
             # a reward function that does not import is said at validate, before any model loads
             ({"grpo": {"rewards": [{"scorer": "no_such_rewards_module:score"}]}},
              "grpo.rewards[0].scorer 'no_such_rewards_module:score': cannot import no_such_rewards_module")]
    for number, (sections, message) in enumerate(cases):
        grpo = sections.pop("grpo", {})
        recipe = grpo_recipe(make_recipe, f"bad{number}.yaml", grpo=grpo, **sections)
        result = invoke("validate", recipe)
        assert result.exit_code == 2, (sections, result.output)
        assert message in result.output, (message, result.output)


def test_a_reward_function_that_raises_is_named_with_its_prompt(make_recipe, tmp_path, monkeypatch):
    (tmp_path / "grpo_picky_rewards.py").write_text(
        "def picky(answer, expected, row):\n"
        "    assert set(row) == {'prompt', 'expected'}\n"
        "    return 1.0 if len(answer) < 5 else None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(make_recipe, grpo={"rewards": [{"scorer": "grpo_picky_rewards:picky"}]})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert "grpo_picky_rewards:picky returned None on step 1, prompt " in result.output
    assert "### Response:" in result.output and "Traceback" not in result.output


def test_status_report_and_trackers_show_the_rewards(make_recipe, tmp_path):
    from gpupoor.train.trackers import tracker_values

    recipe = grpo_recipe(make_recipe, training={"max_steps": 2})
    assert invoke("train", recipe, "--output-dir", tmp_path / "run").exit_code == 0
    result = invoke("status", tmp_path / "run")
    assert result.exit_code == 0, result.output
    first, last = steps(tmp_path / "run")
    assert (f"reward {last['reward']:.3f} over the last 1 steps (the first 1: {first['reward']:.3f}); spread in a "
            "group") in result.output
    values = tracker_values(first)
    assert values["train/reward"] == first["reward"] and values["train/reward/exact"] == first["reward_exact"]
    assert values["train/kl"] == first["kl"] and values["train/reward/length_8"] == first["reward_length_8"]
    assert tracker_values({"eval_loss": 1.0, "eval_reward_exact": 0.5})["eval/reward/exact"] == 0.5

    from gpupoor.commands.report import load_runs, other_panels

    figure = other_panels(load_runs([tmp_path / "run"]))
    assert figure.axes[1].get_title(loc="left").startswith("mean reward of the sampled answers")


def test_validate_says_a_grpo_section_is_unused_without_the_objective(make_recipe):
    result = invoke("validate", make_recipe(grpo={"group_size": 8, "beta": 0.1}))
    assert result.exit_code == 0, result.output
    assert "the grpo section (beta, group_size) is unused: training.objective is sft" in result.output
    result = invoke("validate", grpo_recipe(make_recipe))
    assert result.exit_code == 0 and "is unused" not in result.output, result.output


def test_with_gradient_checkpointing_the_update_reads_whole_rows(make_recipe, tmp_path):
    """Checkpointing drops the KV cache in training: the update (and the reference) read every prompt with each
    answer, and say so; the run trains as without."""
    recipe = grpo_recipe(make_recipe, grpo={"beta": 0.04}, memory={"gradient_checkpointing": True},
                         training={"max_steps": 2})
    result = invoke("train", recipe, "--output-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "each prompt read once per answer in the update (several processes or checkpointing)" in result.output
    assert steps(tmp_path / "run")[-1]["kl"] > 0

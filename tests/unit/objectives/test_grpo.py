"""GRPO's arithmetic (gpupoor/objectives/grpo/loss.py) against hand computations in float64, and the scorers its
rewards and eval's metrics share (gpupoor/objectives/scorers.py)."""

from __future__ import annotations

import math

import pytest
import torch

from gpupoor.errors import UserError
from gpupoor.objectives.grpo.loss import group_advantages, policy_loss
from gpupoor.scorers import parse_scorer


def test_advantages_are_relative_to_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    scaled = group_advantages(rewards, 4, eps=0.0)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # the sample standard deviation, as GRPO's
    assert scaled[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert group_advantages(rewards, 4)[4:].tolist() == [0.0] * 4  # all equal: nothing to learn from the group
    assert group_advantages(rewards, 4, scale=False)[:4].tolist() == [0.5, -0.5, -0.5, 0.5]  # Dr. GRPO
    with pytest.raises(ValueError):
        group_advantages(rewards, 3)


def batch():
    """Two answers of 3 and 2 tokens (the second padded), ratios inside and outside the clip."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -2.5, -0.5], [-1.0, -0.2, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -2.0, -0.4], [-1.5, -0.3, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    return logp, old, ref, mask, advantages


def by_hand(logp, old, ref, mask, advantages, epsilon, beta):
    """Each token's loss term as the papers write it, one scalar at a time."""
    terms = []
    for i in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(float(logp[i, t] - old[i, t]))
            a = float(advantages[i])
            surrogate = min(r * a, min(max(r, 1 - epsilon), 1 + epsilon) * a)
            log_ratio = float(ref[i, t] - logp[i, t])
            row.append(-surrogate + beta * (math.exp(log_ratio) - log_ratio - 1))
        terms.append(row)
    return terms


@pytest.mark.parametrize("normalization", ["sequence", "token", "constant"])
def test_the_loss_is_the_clipped_surrogate_plus_the_kl_as_published(normalization):
    logp, old, ref, mask, advantages = batch()
    result = policy_loss(logp, old, advantages, mask, epsilon=0.2, beta=0.05, ref_logp=ref,
                         normalization=normalization, max_new_tokens=3)
    terms = by_hand(logp.detach(), old, ref, mask, advantages, 0.2, 0.05)
    expected = {"sequence": sum(sum(row) / len(row) for row in terms) / len(terms),
                "token": sum(map(sum, terms)) / sum(map(len, terms)),
                "constant": sum(map(sum, terms)) / (2 * 3)}[normalization]
    assert float(result.loss.detach()) == pytest.approx(expected, rel=1e-12)
    # token (0,1): r = e^0.5 > 1.2 with A > 0, and (1,0): r = e^-0.5 < 0.8 with A < 0: both held by the clip
    assert result.clip_fraction == pytest.approx(2 / 5)


def test_clipped_tokens_pass_no_gradient_and_the_others_push_toward_the_advantage():
    logp, old, ref, mask, advantages = batch()
    policy_loss(logp, old, advantages, mask, epsilon=0.2).loss.backward()
    grad = logp.grad
    assert grad[0, 1] == 0 and grad[1, 0] == 0  # clipped
    assert grad[0, 0] < 0 and grad[0, 2] < 0  # A > 0: a step against the gradient raises these log-probs
    assert grad[1, 1] > 0 and grad[1, 2] == 0  # A < 0 lowers it; padding gets nothing


def test_the_kl_is_zero_at_the_reference_and_required_with_beta():
    logp, old, ref, mask, advantages = batch()
    same = policy_loss(logp, old, advantages, mask, beta=0.1, ref_logp=logp.detach())
    assert same.kl == 0.0
    assert policy_loss(logp, old, advantages, mask, beta=0.1, ref_logp=ref).kl > 0
    with pytest.raises(ValueError, match="reference"):
        policy_loss(logp, old, advantages, mask, beta=0.1)


def test_scorers_score_and_name_the_row_when_a_function_fails(tmp_path, monkeypatch):
    assert parse_scorer("exact")(" 2024-03-03 ", "2024-03-03", {}, "r:1") == 1.0
    assert parse_scorer("contains")("it is 42.", "42", {}, "r:1") == 1.0
    assert parse_scorer("json")('{"a": 1}', "", {}, "r:1") == 1.0 and parse_scorer("json")("{", "", {}, "r:1") == 0.0
    assert parse_scorer("regex:^\\d{4}$")("1999", "", {}, "r:1") == 1.0
    length = parse_scorer("length<=10")
    assert [length("x" * n, "", {}, "r:1") for n in (5, 10, 15, 20, 30)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    (tmp_path / "my_rewards.py").write_text(
        "def broken(answer, expected, row):\n    return 1 / 0\n"
        "def unbounded(answer, expected, row):\n    return float(len(answer))\n"
        "def nan(answer, expected, row):\n    return float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="my_rewards:broken raised ZeroDivisionError: division by zero on data.jsonl:7"):
        parse_scorer("my_rewards:broken")("a", "b", {}, "data.jsonl:7")
    assert parse_scorer("my_rewards:unbounded", "grpo.rewards", unit_range=False)("abc", "", {}, "r:1") == 3.0
    with pytest.raises(UserError, match="returned 3.0 on r:1: a score is a bool or a number in"):
        parse_scorer("my_rewards:unbounded")("abc", "", {}, "r:1")
    with pytest.raises(UserError, match="returned nan on r:2"):
        parse_scorer("my_rewards:nan", unit_range=False)("abc", "", {}, "r:2")
    with pytest.raises(UserError, match="is not a scorer gpupoor knows"):
        parse_scorer("bleu")


def test_rewards_are_weighted_sums_of_scorers_and_each_is_kept():
    from gpupoor.scorers import combined_scores

    scorers = [(parse_scorer("exact", unit_range=False), 1.0), (parse_scorer("length<=4", unit_range=False), 0.5)]
    totals, each = combined_scores(scorers, ["42", "42 is it"], ["42", "42"], [{}, {}], ["r:1", "r:2"])
    assert each == {"exact": [1.0, 0.0], "length<=4": [1.0, 0.0]}
    assert totals == [1.5, 0.0]


def test_a_scorer_module_in_the_current_directory_imports_without_it_on_sys_path(tmp_path, monkeypatch):
    """The installed `gpupoor` script's sys.path starts at the venv's bin/, not the current directory: a
    `module:function` there could not be imported, though docs/cli.md and docs/grpo.md promise it."""
    import sys

    (tmp_path / "cwd_only_rewards.py").write_text("def short(answer, expected, row):\n    return len(answer) < 3\n"
                                                  "NOT_A_FUNCTION = 3\n")
    (tmp_path / "cwd_broken_rewards.py").write_text("def short(answer:\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert parse_scorer("cwd_only_rewards:short")("ab", "", {}, "r:1") == 1.0
    assert str(tmp_path) not in sys.path  # looked in, not left there
    with pytest.raises(UserError, match="cwd_only_rewards.NOT_A_FUNCTION is int data, not a function"):
        parse_scorer("cwd_only_rewards:NOT_A_FUNCTION")
    with pytest.raises(UserError, match="module cwd_only_rewards has no missing"):
        parse_scorer("cwd_only_rewards:missing")
    with pytest.raises(UserError, match="cannot import cwd_broken_rewards \\(SyntaxError"):
        parse_scorer("cwd_broken_rewards:short")

"""GRPO killed outright (SIGKILL, in a process of its own) at a random step, in the middle of writing a
checkpoint: the resumed run samples the same answers and ends with the same adapter, bitwise, as a run never
stopped. Dropout on and two updates per sampling, so the restored RNG and the kept rollout both matter."""

from __future__ import annotations

import random
import signal

from support.cli import invoke, run_cli
from support.runs import assert_same_run, read_metrics

GRPO = {"group_size": 4, "max_new_tokens": 6, "beta": 0.04, "iterations": 2,
        "rewards": [{"scorer": "length<=8"}, {"scorer": "exact", "weight": 2}]}


def test_grpo_resumes_bitwise_after_a_sigkill_at_a_random_step(make_recipe, tmp_path, monkeypatch):
    recipe = make_recipe("grpo.yaml", training={"objective": "grpo", "micro_batch_size": 2, "max_steps": 7,
                                                "gradient_accumulation_steps": 2},
                         peft={"rank": 4, "dropout": 0.1}, grpo=GRPO, checkpoint={"every_steps": 1})
    straight = tmp_path / "straight"
    assert invoke("train", recipe, "--output-dir", straight, monkeypatch=monkeypatch).exit_code == 0
    step = random.randint(2, 6)  # (any step must do: the draw is in the message when one does not)
    run = tmp_path / "killed"
    killed = run_cli(["train", recipe, "--output-dir", run], {"GPUPOOR_FAULT": f"kill@weights:{step}"})
    assert killed.returncode == -signal.SIGKILL, (step, killed.stderr[-2000:])
    resumed = invoke("resume", run, monkeypatch=monkeypatch)
    assert resumed.exit_code == 0, (step, resumed.output)
    assert f"resuming from step-{step - 1:06d}" in resumed.output, step
    assert_same_run(straight, run)
    keys = ("reward", "reward_std", "kl", "clip_fraction", "answer_tokens", "grad_norm")
    last = {r["step"]: r for r in read_metrics(run) if "loss" in r}  # the resumed session's records win
    for record in (r for r in read_metrics(straight) if "loss" in r):
        assert [record[k] for k in keys] == [last[record["step"]][k] for k in keys], (step, record["step"])

"""Learning quality of DPO: on the demo's reversal task the reward accuracy and greedy decoding improve."""

from __future__ import annotations

import json

from support.cli import invoke
from support.rows import write_jsonl
from support.runs import read_metrics
from gpupoor.data.encoder import Encoder

from support.preference import _one_thread


def test_dpo_on_the_demo_task_raises_reward_and_greedy_accuracy(tmp_path, monkeypatch):
    """The demo's reversal task, the documented two stages: a short SFT (a model that reverses some inputs), merged;
    then DPO with a new adapter on pairs (the reversal chosen, a wrong one rejected). On held-out pairs the reward
    accuracy climbs from 50% (the policy starts equal to its reference) toward 100%, and greedy decoding gets more
    reversals right."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpupoor.model.demo_task import preference_split
    from gpupoor.model.generation import complete

    train, held_out = preference_split(2400, 100, prompt=lambda letters: f"{letters} = ")  # short prompts: fast
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": r["prompt"], "completion": r["chosen"]} for r in train])
    write_jsonl(tmp_path / "pairs.jsonl", train)
    write_jsonl(tmp_path / "held-out.jsonl", held_out)
    common = {"logging": {"progress": "none"}, "seed": 0}
    sft = {"model": {"name_or_path": "gpupoor:demo"}, "peft": {"rank": 32, "modules_to_save": ["embed_tokens", "lm_head"]},
           "data": {"path": "sft.jsonl", "format": "completion", "max_length": 64, "sampler": "random"},
           "training": {"micro_batch_size": 16, "max_steps": 65, "learning_rate": 2e-3, "warmup_steps": 0,
                        "cpu_threads": 1}, **common}
    (tmp_path / "sft.yaml").write_text(json.dumps(sft))
    assert invoke("train", tmp_path / "sft.yaml", "--output-dir", tmp_path / "sft").exit_code == 0
    assert invoke("merge-lora", tmp_path / "sft", "--output", tmp_path / "merged").exit_code == 0
    dpo = {"model": {"name_or_path": "merged"}, "peft": {"rank": 16},
           "data": {"path": "pairs.jsonl", "format": "preference", "max_length": 64, "sampler": "random",
                    "eval_path": "held-out.jsonl"},
           "training": {"objective": "dpo", "micro_batch_size": 16, "max_steps": 60, "learning_rate": 1e-3,
                        "warmup_steps": 0, "cpu_threads": 1, "eval_every_steps": 20},
           "preference": {"beta": 0.5}, **common}
    (tmp_path / "dpo.yaml").write_text(json.dumps(dpo))
    result = invoke("train", tmp_path / "dpo.yaml", "--output-dir", tmp_path / "dpo")
    assert result.exit_code == 0, result.output

    rewards = [r["eval_rewards/accuracies"] for r in read_metrics(tmp_path / "dpo") if "eval_loss" in r]
    assert rewards[-1] >= 0.8 and rewards[-1] >= rewards[0], rewards
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    prompts = [Encoder(tokenizer, "preference", 64).encode_prompt(row, "held-out") for row in held_out]

    def greedy(model) -> float:
        return sum(a == r["chosen"] for a, r in zip(complete(model, tokenizer, prompts, 12), held_out)) / len(held_out)

    before = greedy(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"))
    after = greedy(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"),
                                             tmp_path / "dpo" / "final"))
    assert after >= before + 0.1, (before, after, rewards)

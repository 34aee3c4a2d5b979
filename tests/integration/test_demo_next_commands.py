"""The commands `make demo` tells a new user to try next all work, as printed, on the run it made."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from support.cli import invoke
from support.recipes import write_recipe
from support.rows import alpaca_rows, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_every_command_the_demo_suggests_runs_on_its_run(tmp_path, monkeypatch, tiny_model):
    from gpupoor.scripts.demo import PROMPTS, next_commands

    monkeypatch.chdir(tmp_path)  # the demo's commands are relative to the clone: merged/ lands here
    (tmp_path / PROMPTS).parent.mkdir(parents=True)
    shutil.copy(REPO / PROMPTS, tmp_path / PROMPTS)
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(40))
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_model, data, data={"eval_rows": 8},
                          training={"max_steps": 4})
    run = Path("runs/demo-test")
    assert invoke("train", recipe, "--output-dir", run).exit_code == 0
    for command, _ in next_commands(run):
        words = shlex.split(command)
        assert words[0] == "gpupoor"
        result = invoke(*words[1:])
        assert result.exit_code == 0, f"{command}:\n{result.output}"
    card = (tmp_path / "runs/demo-test/final/README.md").read_text()
    assert "library_name: peft" in card and "base_model:" not in card  # the base is a local directory
    assert (tmp_path / "runs/demo-test/report.html").is_file()
    assert (tmp_path / "merged/demo-test/config.json").is_file()
    assert (tmp_path / "runs/demo-test/gguf/demo-test-q8_0.gguf").is_file()


def test_the_readmes_train_merge_try_block_runs_as_written(tmp_path, monkeypatch):
    """README "Train, merge, try", command by command, from a copy of the clone's recipes/: the one change is a
    shorter training (--set training.max_steps=6, not the demo's 225 steps). `chat runs/demo-real` needs `make
    demo-real` first, as the README says (chat on a chat-format run: tests/integration/test_chat.py)."""
    import re

    from typer.testing import CliRunner

    from gpupoor.cli import app

    readme = (REPO / "README.md").read_text()
    block = re.search(r"## Train, merge, try\n\n```\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith("gpupoor ")]
    assert [shlex.split(c)[1] for c in commands] == ["train", "merge-lora", "generate", "generate", "chat", "chat"]
    monkeypatch.chdir(tmp_path)
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    for command in commands:
        words = shlex.split(command)[1:]
        if words == ["chat", "runs/demo-real"]:
            continue
        if words[0] == "train":
            words += ["--set", "training.max_steps=6"]
        result = CliRunner().invoke(app, words, input="Reverse the letters.\n/exit\n")
        assert result.exit_code == 0, f"{command}:\n{result.output}"
        if words[0] == "generate":
            prompts = (REPO / "recipes/data/prompts.jsonl").read_text().splitlines()
            assert result.output.count('"completion"') == len(prompts)
        if words[0] == "chat":
            assert "model>" in result.output
    assert (tmp_path / "runs/demo/final/adapter_config.json").is_file()
    assert (tmp_path / "merged/demo/config.json").is_file()
    # What the README says next: the adapter loads with peft alone, its base found through adapter_config.json.
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained("runs/demo/final")
    assert model.peft_config["default"].r == 32


def test_the_readmes_demo_transcript_has_the_summary_lines_a_demo_prints_today(tmp_path, monkeypatch):
    """The start-up summary in README's "What the demo shows" against a (shortened) run of the demo's own recipe:
    the same lines in the same order (each known by its first two words, numbers aside), so the transcript a new
    user reads is what they will see."""
    import re

    def kinds(lines: list[str]) -> list[str]:
        return [" ".join(re.sub(r"\d[\d,.]*", "#", line).split()[:2]) for line in lines]

    def summary(text: str) -> list[str]:
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("gpupoor train: "))
        block = []
        for line in lines[start + 1:]:
            if not line.startswith("  "):  # the summary ends where the step lines start
                break
            block.append(line)
        return block

    readme = (REPO / "README.md").read_text()
    transcript = re.search(r"## What the demo shows\n.*?```\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(REPO)
    result = invoke("train", "recipes/demo.yaml", "--output-dir", tmp_path / "demo", "--set", "training.max_steps=6")
    assert result.exit_code == 0, result.output
    assert kinds(summary(transcript)) == kinds(summary(result.output)), (summary(transcript), summary(result.output))

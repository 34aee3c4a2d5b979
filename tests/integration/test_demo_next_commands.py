"""The commands `make demo` tells a new user to try next all work, as printed, on the run it made."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from conftest import alpaca_rows, invoke, write_jsonl, write_recipe

REPO = Path(__file__).resolve().parents[2]


def test_every_command_the_demo_suggests_runs_on_its_run(tmp_path, monkeypatch, tiny_model):
    from gpupoor.commands.demo import PROMPTS, next_commands

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

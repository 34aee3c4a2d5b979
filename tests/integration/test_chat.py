"""`gpupoor chat`: a conversation in the run's format, with /system, /reset and /exit."""

from __future__ import annotations

from typer.testing import CliRunner

from support.cli import invoke
from support.recipes import write_recipe
from support.rows import alpaca_rows, write_jsonl
from gpupoor.cli import app


def test_chat_answers_each_message_and_obeys_its_commands(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(16))
    run = tmp_path / "run"
    assert invoke("train", write_recipe(tmp_path / "r.yaml", tiny_model, data, training={"max_steps": 2}),
                  "--output-dir", run).exit_code == 0
    too_long = " ".join(["letters"] * 3000)  # past the tiny model's 1024-token context
    session = f"Reverse the letters.\n/system Be brief.\n/bogus\n{too_long}\n/reset\nagain\n/exit\nnever read\n"
    result = CliRunner().invoke(app, ["chat", str(run), "--max-new-tokens", "3"], input=session)
    assert result.exit_code == 0, result.output
    assert "alpaca format: each line is an instruction, answered on its own" in result.output
    assert result.output.count("model> ") == 2  # two messages answered; the commands are not sent to the model
    assert "(/system does not apply to the alpaca format" in result.output
    assert "unknown command /bogus" in result.output
    assert "but the model's context is 1024" in result.output and "/reset starts over)" in result.output
    # --history on an alpaca run was silently ignored: it is said
    result = CliRunner().invoke(app, ["chat", str(run), "--max-new-tokens", "2", "--history"], input="hi\n")
    assert result.exit_code == 0, result.output
    assert "warning: --history has no effect here: the alpaca run's lines are each answered on their own" \
        in result.output


def test_chat_keeps_the_conversation_of_a_chat_run(tmp_path, tiny_model, monkeypatch):
    """A chat-format run: each turn is rendered with the whole conversation so far (and the system prompt)."""
    from gpupoor.data import encoder as encoder_module

    rows = [{"messages": [{"role": "user", "content": f"hi {n}"}, {"role": "assistant", "content": "hello"}]}
            for n in range(16)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", tiny_model, data, data={"format": "chat", "chat_template": "chatml"},
                          training={"max_steps": 2})
    assert invoke("train", recipe, "--output-dir", run).exit_code == 0
    rendered = []
    original = encoder_module.Encoder.encode_prompt

    def spy(self, row, where):
        rendered.append(row)
        return original(self, row, where)

    monkeypatch.setattr(encoder_module.Encoder, "encode_prompt", spy)
    result = CliRunner().invoke(app, ["chat", str(run), "--max-new-tokens", "2", "--history"],
                                input="/system Be kind.\nfirst\nsecond\n")
    assert result.exit_code == 0, result.output
    assert "the conversation is carried (--history)" in result.output
    first, second = (row["messages"] for row in rendered)
    assert [m["role"] for m in first] == ["system", "user"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[1]["content"] == "first" and second[3]["content"] == "second"

    # By default the run's rows decide: single exchanges, so each turn is answered alone, as it trained.
    rendered.clear()
    result = CliRunner().invoke(app, ["chat", str(run), "--max-new-tokens", "2"], input="first\nsecond\n/input x\n")
    assert result.exit_code == 0, result.output
    assert "each turn is answered alone, as the run's rows were single exchanges" in result.output
    assert [row["messages"] for row in rendered] == [[{"role": "user", "content": "first"}],
                                                     [{"role": "user", "content": "second"}]]
    assert "(/input does not apply to the chat format" in result.output


def test_chat_on_an_alpaca_run_takes_an_instructions_input(tmp_path, tiny_model, monkeypatch):
    """The demo's task is an instruction with letters as its input: /input gives every following instruction that
    input, as the training rows had; /system, which an alpaca prompt has no place for, says so."""
    from gpupoor.data import encoder as encoder_module

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(16))
    run = tmp_path / "run"
    assert invoke("train", write_recipe(tmp_path / "r.yaml", tiny_model, data, training={"max_steps": 2}),
                  "--output-dir", run).exit_code == 0
    rendered = []
    original = encoder_module.Encoder.encode_prompt
    monkeypatch.setattr(encoder_module.Encoder, "encode_prompt",
                        lambda self, row, where: rendered.append(row) or original(self, row, where))
    session = "/input a b c d\nReverse the letters.\n/system Be brief.\n/input\nSay hi.\n"
    result = CliRunner().invoke(app, ["chat", str(run), "--max-new-tokens", "2"], input=session)
    assert result.exit_code == 0, result.output
    assert "/input TEXT gives it an input" in result.output and "(input: a b c d)" in result.output
    assert rendered == [{"instruction": "Reverse the letters.", "input": "a b c d"}, {"instruction": "Say hi."}]
    assert "(/system does not apply to the alpaca format this run trained on: its prompts have no system" \
        " turn)" in result.output

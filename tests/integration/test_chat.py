"""`gpupoor chat`: a conversation in the run's format, with /system, /reset and /exit."""

from __future__ import annotations

from typer.testing import CliRunner

from conftest import alpaca_rows, invoke, write_jsonl, write_recipe
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
    assert "alpaca format: each message is answered on its own" in result.output
    assert result.output.count("model> ") == 2  # two messages answered; the commands are not sent to the model
    assert "(started over; system prompt: Be brief.)" in result.output
    assert "unknown command /bogus" in result.output
    assert "but the model's context is 1024" in result.output and "/reset starts over)" in result.output


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
    result = CliRunner().invoke(app, ["chat", str(run), "--max-new-tokens", "2"],
                                input="/system Be kind.\nfirst\nsecond\n")
    assert result.exit_code == 0, result.output
    first, second = (row["messages"] for row in rendered)
    assert [m["role"] for m in first] == ["system", "user"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[1]["content"] == "first" and second[3]["content"] == "second"

"""Chat masking on a real chat template: SmolLM2-135M-Instruct's, read from its GGUF by plain transformers. The
template injects a default system prompt when a conversation has none, so the text before the first reply is
not the rows' own. The labels gpupoor's Encoder makes, and what `validate --show` marks, must be exactly the
assistant replies as the template itself renders them: each is what rendering the conversation up to and with
that reply adds to the rendering up to it with the generation prompt ("<|im_start|>assistant\\n")."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gpupoor.cli import app
from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.data.encoder import Encoder

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CONVERSATIONS = {
    "no system prompt (the template adds its own)": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."}],
    "its own system prompt": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."}],
}


@pytest.fixture(scope="module")
def real_tokenizer(real_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)


def reply_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The template's rendering of the whole conversation, and each assistant reply's (start, end) in it."""
    def render(part: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=generation_prompt)

    full, spans = render(messages, False), []
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            before, after = render(messages[:index], True), render(messages[: index + 1], False)
            assert after.startswith(before) and full.startswith(after)  # this template only grows
            spans.append((len(before), len(after)))
    return full, spans


def test_the_template_injects_a_default_system_prompt(real_tokenizer):
    full, _ = reply_spans(real_tokenizer, CONVERSATIONS["no system prompt (the template adds its own)"])
    assert full.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_exactly_the_assistant_replies_are_labelled(real_tokenizer, name):
    messages = CONVERSATIONS[name]
    full, spans = reply_spans(real_tokenizer, messages)
    encoded = Encoder(real_tokenizer, "chat", max_length=1024).encode({"messages": messages}, "row")

    # The same tokens as the template's whole rendering tokenized at once (no BOS: this tokenizer adds none)...
    whole = real_tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded.input_ids == whole.input_ids and not encoded.truncated
    # ...and a token is labelled (with itself) exactly when its text lies inside a reply.
    inside = [any(start <= low and high <= end for start, end in spans) for low, high in whole.offset_mapping]
    assert [label != IGNORE_INDEX for label in encoded.labels] == inside
    assert all(label in (IGNORE_INDEX, token) for label, token in zip(encoded.labels, encoded.input_ids))
    trained_text = real_tokenizer.decode([t for t, label in zip(encoded.input_ids, encoded.labels)
                                          if label != IGNORE_INDEX])
    assert trained_text == "".join(full[start:end] for start, end in spans)
    for message in messages:  # every reply trained, with the <|im_end|> that ends it; nothing else
        assert (message["content"] + "<|im_end|>" in trained_text) == (message["role"] == "assistant")
    assert DEFAULT_SYSTEM not in trained_text and "<|im_start|>" not in trained_text


def test_validate_show_marks_the_replies(real_tokenizer, real_gguf, tmp_path):
    # The recipe names the GGUF itself: `validate --show` loads its tokenizer and never its weights.
    rows = list(CONVERSATIONS.values())
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{name_or_path: {real_gguf}}}\n"
                      f"data: {{path: {data}, format: chat, max_length: 1024}}\n")

    result = CliRunner().invoke(app, ["validate", str(recipe), "--show", "2"])
    assert result.exit_code == 0, result.output
    for messages in rows:
        full, spans = reply_spans(real_tokenizer, messages)
        marked, cursor = "", 0
        for start, end in spans:
            marked += full[cursor:start] + "«" + full[start:end] + "»"
            cursor = end
        assert marked + full[cursor:] in result.output, result.output


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_the_named_smollm2_template_is_the_models_own(real_tokenizer, case):
    """data.chat_template: smollm2 is SmolLM2-Instruct's template byte for byte (as its GGUF carries it), so
    naming it trains exactly what the model's own tokenizer would: the same ids, the same labels."""
    from gpupoor.data.chat_templates import resolve_chat_template

    assert resolve_chat_template("smollm2") == real_tokenizer.chat_template
    row = {"messages": CONVERSATIONS[case]}
    own = Encoder(real_tokenizer, "chat", 1024).encode(row, "x:1")
    named = Encoder(real_tokenizer, "chat", 1024, chat_template="smollm2").encode(row, "x:1")
    assert named.input_ids == own.input_ids and named.labels == own.labels
    assert any(label != IGNORE_INDEX for label in named.labels)

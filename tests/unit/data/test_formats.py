"""Data formats beyond the basics: named chat templates against each family's documented format, exact loss
masking, ShareGPT rows, tokenized rows, the no-template error, mixture preflight and `validate --show`."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from support.rows import write_jsonl
from gpupoor.cli import app
from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.data.encoder import Encoder
from gpupoor.data.chat_templates import NAMES, TEMPLATES, resolve_chat_template
from gpupoor.errors import UserError

SYSTEM, USER_1, REPLY_1, USER_2, REPLY_2 = "be brief", "sort lists", "done quickly", "reverse", "the answer"
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_1},
                {"role": "assistant", "content": REPLY_1}, {"role": "user", "content": USER_2},
                {"role": "assistant", "content": REPLY_2}]

# ChatML: <|im_start|>ROLE\n ... <|im_end|>\n per turn, no BOS in the template (the tokenizer's own is kept).
CHATML = [("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nsort lists<|im_end|>\n<|im_start|>assistant\n",
           False),
          ("done quickly<|im_end|>\n", True),
          ("<|im_start|>user\nreverse<|im_end|>\n<|im_start|>assistant\n", False),
          ("the answer<|im_end|>\n", True)]

# Each family's format written out by hand from its documentation (the test tokenizer's BOS is <s>, its EOS </s>),
# as (text, trained) pieces; then what ends an assistant turn and whether gpupoor appends EOS (it does unless
# the last trained piece already holds the tokenizer's EOS).
FAMILY_FORMATS = {
    # Meta's Llama 3 prompt format: a header per turn, each turn ends with <|eot_id|>; BOS first.
    "llama3": ([("<s><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nsort lists<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
                ("done quickly<|eot_id|>", True),
                ("<|start_header_id|>user<|end_header_id|>\n\nreverse<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
                ("the answer<|eot_id|>", True)], "<|eot_id|>", True),
    "chatml": (CHATML, "<|im_end|>\\n", True),
    # Gemma: <start_of_turn>user|model ... <end_of_turn>\n; no system role: the system prompt opens the first user
    # turn, followed by a blank line; BOS first.
    "gemma": ([("<s><start_of_turn>user\nbe brief\n\nsort lists<end_of_turn>\n<start_of_turn>model\n", False),
               ("done quickly<end_of_turn>\n", True),
               ("<start_of_turn>user\nreverse<end_of_turn>\n<start_of_turn>model\n", False),
               ("the answer<end_of_turn>\n", True)], "<end_of_turn>\\n", True),
    # Mistral tokenizer v3: <s>[INST] user[/INST] reply</s>, the system prompt before the LAST user message
    # (mistral-common's rule), each reply ends with EOS: nothing appended.
    "mistral": ([("<s>[INST] sort lists[/INST]", False), (" done quickly</s>", True),
                 ("[INST] be brief\n\nreverse[/INST]", False), (" the answer</s>", True)], "</s>", False),
    # Phi-3: <|role|>\n ... <|end|>\n per turn; EOS closes the whole conversation (so it is trained once, at the
    # end, and not appended again).
    "phi3": ([("<|system|>\nbe brief<|end|>\n<|user|>\nsort lists<|end|>\n<|assistant|>\n", False),
              ("done quickly<|end|>\n", True),
              ("<|user|>\nreverse<|end|>\n<|assistant|>\n", False),
              ("the answer<|end|>\n</s>", True)], "<|end|>\\n", False),
    # Qwen2.5 and SmolLM2: ChatML; a conversation with a system turn renders as plain ChatML (their default system
    # prompts are tested below).
    "qwen2.5": (CHATML, "<|im_end|>\\n", True),
    "smollm2": (CHATML, "<|im_end|>\\n", True),
    # DeepSeek V3: BOS, the system prompt bare, <｜User｜>...<｜Assistant｜>reply<｜end▁of▁sentence｜> (a token of
    # DeepSeek's own vocabulary, not this tokenizer's EOS: EOS is appended).
    "deepseek": ([("<s>be brief<｜User｜>sort lists<｜Assistant｜>", False),
                  ("done quickly<｜end▁of▁sentence｜>", True),
                  ("<｜User｜>reverse<｜Assistant｜>", False),
                  ("the answer<｜end▁of▁sentence｜>", True)], "<｜end▁of▁sentence｜>", True),
    # Llama 2 Chat: BOS before every [INST]; the system prompt in <<SYS>> inside the first; " reply </s>".
    "llama2": ([("<s>[INST] <<SYS>>\nbe brief\n<</SYS>>\n\nsort lists [/INST]", False),
                (" done quickly </s>", True),
                ("<s>[INST] reverse [/INST]", False),
                (" the answer </s>", True)], " </s>", False),
    # Vicuna v1.1 (FastChat ADD_COLON_TWO): "SYSTEM USER: u ASSISTANT: a</s>USER: ...", no BOS of its own.
    "vicuna": ([("be brief USER: sort lists ASSISTANT:", False),
                (" done quickly</s>", True),
                ("USER: reverse ASSISTANT:", False),
                (" the answer</s>", True)], "</s>", False),
    # Alpaca as a chat: the system message in place of the preamble, turns separated by a blank line.
    "alpaca-chat": ([("be brief\n\n### Instruction:\nsort lists\n\n### Response:\n", False),
                     ("done quickly</s>", True),
                     ("\n\n### Instruction:\nreverse\n\n### Response:\n", False),
                     ("the answer</s>", True)], "EOS", False),
}

# What each template writes for a conversation of one user message and no system turn, ready for the reply:
# the default system prompts the families were tuned with (Qwen2.5's, SmolLM2's, FastChat's for Vicuna, Alpaca's
# preamble), and none where the family has none.
WITHOUT_SYSTEM = {
    "qwen2.5": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
               "<|im_start|>user\nsort lists<|im_end|>\n<|im_start|>assistant\n",
    "smollm2": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\nsort lists<|im_end|>\n<|im_start|>assistant\n",
    "chatml": "<|im_start|>user\nsort lists<|im_end|>\n<|im_start|>assistant\n",
    "vicuna": "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
              "detailed, and polite answers to the user's questions. USER: sort lists ASSISTANT:",
    "alpaca-chat": "Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.\n\n### Instruction:\nsort lists\n\n### Response:\n",
    "deepseek": "<s><｜User｜>sort lists<｜Assistant｜>",
    "llama2": "<s>[INST] sort lists [/INST]",
}


def trained_ids(encoded) -> list[int]:
    return [token for token, label in zip(encoded.input_ids, encoded.labels) if label != IGNORE_INDEX]


def test_every_named_template_is_tested_and_documented():
    assert set(FAMILY_FORMATS) == set(NAMES) == {"llama3", "chatml", "gemma", "mistral", "phi3", "qwen2.5",
                                                 "smollm2", "deepseek", "llama2", "vicuna", "alpaca-chat"}
    for name, template in TEMPLATES.items():
        assert template.source and template.family
        assert FAMILY_FORMATS[name][1] in template.turn_end


@pytest.mark.parametrize("name", sorted(FAMILY_FORMATS))
def test_named_template_renders_the_family_format(tokenizer, name):
    pieces, _, _ = FAMILY_FORMATS[name]
    encoder = Encoder(tokenizer, "chat", 1024, chat_template=name)
    segments = encoder.segments({"messages": CONVERSATION}, "x:1")
    assert "".join(text for text, _ in segments) == "".join(text for text, _ in pieces)
    assert [text for text, trained in segments if trained] == [text for text, trained in pieces if trained]


@pytest.mark.parametrize("name", sorted(FAMILY_FORMATS))
def test_named_template_trains_exactly_the_replies(tokenizer, name):
    pieces, _, eos_appended = FAMILY_FORMATS[name]
    encoded = Encoder(tokenizer, "chat", 1024, chat_template=name).encode({"messages": CONVERSATION}, "x:1")
    replies = [text for text, trained in pieces if trained]
    expected = [token for reply in replies for token in tokenizer(reply, add_special_tokens=False).input_ids]
    expected += [tokenizer.eos_token_id] if eos_appended else []
    assert trained_ids(encoded) == expected  # token for token: the replies (end-of-turn marker included) only
    assert tokenizer.decode(trained_ids(encoded)) == "".join(replies) + ("</s>" if eos_appended else "")
    whole = "".join(text for text, _ in pieces)
    bos = "" if whole.startswith("<s>") else "<s>"  # the template writes BOS, or the tokenizer's is kept
    assert tokenizer.decode(encoded.input_ids) == bos + whole + ("</s>" if eos_appended else "")
    assert encoded.input_ids.count(tokenizer.bos_token_id) == max(1, whole.count("<s>"))  # Llama 2: one a turn
    # One trained run per reply (the appended EOS joins the last): nothing between replies leaks in.
    runs = sum(1 for i, label in enumerate(encoded.labels)
               if label != IGNORE_INDEX and (i == 0 or encoded.labels[i - 1] == IGNORE_INDEX))
    assert runs == len(replies)


@pytest.mark.parametrize("name", sorted(WITHOUT_SYSTEM))
def test_named_template_without_a_system_turn(tokenizer, name):
    encoder = Encoder(tokenizer, "chat", 1024, chat_template=name)
    assert encoder.render([{"role": "user", "content": USER_1}], True, "x:1") == WITHOUT_SYSTEM[name]
    # The default system prompt is prompt, never trained; the reply is, token for token.
    encoded = encoder.encode({"messages": CONVERSATION[1:3]}, "x:1")
    reply = FAMILY_FORMATS[name][0][1][0]
    assert tokenizer.decode(trained_ids(encoded)).startswith(reply)


def test_alpaca_chat_is_the_alpaca_format_turn_by_turn(tokenizer):
    """One turn of alpaca-chat is token for token (labels too) what the `alpaca` format makes of the same row, so a
    run trained on Alpaca rows can be chatted with, and Alpaca and chat rows can share a run."""
    alpaca = Encoder(tokenizer, "alpaca", 1024).encode({"instruction": USER_1, "output": REPLY_1}, "x:1")
    chat = Encoder(tokenizer, "chat", 1024, chat_template="alpaca-chat").encode(
        {"messages": [{"role": "user", "content": USER_1}, {"role": "assistant", "content": REPLY_1}]}, "x:1")
    assert chat.input_ids == alpaca.input_ids and chat.labels == alpaca.labels


def test_qwen_template_is_the_published_one_with_tools(tokenizer):
    """The shipped qwen2.5 file is Qwen's whole template, tool calls included (what its tokenizer writes for a
    function-calling conversation), not a ChatML look-alike."""
    tools = [{"type": "function", "function": {"name": "sort", "description": "sort a list",
                                               "parameters": {"type": "object", "properties": {}}}}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": USER_1}], tools=tools, tokenize=False,
                                         chat_template=resolve_chat_template("qwen2.5"), add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                           "assistant.\n\n# Tools\n\nYou may call one or more functions")
    assert '<tools>\n{"type": "function", "function": {"name": "sort"' in text
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nsort lists<|im_end|>\n<|im_start|>assistant\n")


def test_template_name_jinja_and_typo():
    assert resolve_chat_template(None) is None
    assert resolve_chat_template("chatml").startswith("{% for message in messages %}")
    jinja = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert resolve_chat_template(jinja) == jinja
    with pytest.raises(UserError) as info:
        resolve_chat_template("llama-3")
    message = str(info.value)
    assert "data.chat_template: 'llama-3' is not a template name" in message
    assert "did you mean 'llama3'" in message and "chatml, gemma, mistral, phi3, qwen2.5" in message
    with pytest.raises(UserError, match="did you mean 'smollm2'"):
        resolve_chat_template("smollm")


# No silent ChatML ---------------------------------------------------------------------------------------------


def test_chat_without_any_template_is_an_error_at_training(tokenizer):
    assert tokenizer.chat_template is None
    for fmt in ("chat", "sharegpt"):
        with pytest.raises(UserError, match="data.chat_template is not set and the tokenizer has no chat template"):
            Encoder(tokenizer, fmt, 128)
    Encoder(tokenizer, "alpaca", 128)  # formats without conversations need no template


def validate(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["validate", *map(str, args)])
    return result.exit_code, result.output


def chat_rows(tmp_path, name="chat.jsonl", count=2):
    return write_jsonl(tmp_path / name, [{"messages": CONVERSATION[1:3]}] * count)


def test_chat_without_any_template_fails_validate(make_recipe, tmp_path):
    code, output = validate(make_recipe(data={"path": str(chat_rows(tmp_path)), "format": "chat"}))
    assert code == 2, output
    assert "data.chat_template is not set" in output and "tokenizer has no chat template" in output
    assert "llama3, chatml, gemma, mistral, phi3" in output and "Jinja template" in output


def test_tokenizer_with_its_own_template_needs_none(make_recipe, tmp_path, tiny_model):
    from transformers import AutoTokenizer

    model = shutil.copytree(tiny_model, tmp_path / "templated")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = resolve_chat_template("chatml")
    tokenizer.save_pretrained(model)
    recipe = make_recipe(model={"name_or_path": str(model)}, data={"path": str(chat_rows(tmp_path)), "format": "chat"})
    code, output = validate(recipe)
    assert code == 0, output


def fake_hub_cache(root, config: dict, jinja: str | None, jinja_known_missing: bool = False):
    """The hub cache layout huggingface_hub reads: refs/main -> snapshots/SHA/FILE, .no_exist/SHA/FILE."""
    repo = root / "models--owner--chatty"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (snapshot / "chat_template.jinja").write_text(jinja)
    if jinja_known_missing:
        (repo / ".no_exist" / "abc123").mkdir(parents=True)
        (repo / ".no_exist" / "abc123" / "chat_template.jinja").write_text("")


@pytest.mark.parametrize("config, jinja, missing, expected", [
    ({"chat_template": "{{ messages }}"}, None, True, True),
    ({}, "{{ messages }}", False, True),
    ({}, None, True, False),  # the cache knows the tokenizer has no template anywhere
    ({}, None, False, None),  # chat_template.jinja never looked up: cannot tell
])
def test_hub_tokenizer_template_from_the_cache(tmp_path, monkeypatch, config, jinja, missing, expected):
    import huggingface_hub.constants

    from gpupoor.commands.validate import tokenizer_has_chat_template

    fake_hub_cache(tmp_path / "hub", config, jinja, missing)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert tokenizer_has_chat_template("owner/chatty", tmp_path) is expected
    assert tokenizer_has_chat_template("nobody-here/no-such-model", tmp_path) is None


# ShareGPT -----------------------------------------------------------------------------------------------------

SHAREGPT = [{"from": "system", "value": SYSTEM}, {"from": "human", "value": USER_1}, {"from": "gpt", "value": REPLY_1},
            {"from": "human", "value": USER_2}, {"from": "gpt", "value": REPLY_2}]


def test_sharegpt_encodes_exactly_like_the_chat_row(tokenizer):
    chat = Encoder(tokenizer, "chat", 256, chat_template="chatml").encode({"messages": CONVERSATION}, "x:1")
    sharegpt = Encoder(tokenizer, "sharegpt", 256, chat_template="chatml").encode({"conversations": SHAREGPT}, "x:1")
    assert (sharegpt.input_ids, sharegpt.labels) == (chat.input_ids, chat.labels)


def test_sharegpt_custom_field_and_roles(tokenizer):
    turns = [{"from": "asker", "value": USER_1}, {"from": "bot", "value": REPLY_1}]
    encoder = Encoder(tokenizer, "sharegpt", 256, chat_template="chatml", conversations_field="turns",
                      sharegpt_roles={"asker": "user", "bot": "assistant"})
    encoded = encoder.encode({"turns": turns}, "x:1")
    assert tokenizer.decode(trained_ids(encoded)) == "done quickly<|im_end|>\n</s>"


def test_sharegpt_prompt_for_generate(tokenizer):
    chat = Encoder(tokenizer, "chat", 256, chat_template="chatml")
    sharegpt = Encoder(tokenizer, "sharegpt", 256, chat_template="chatml")
    # The trailing reply (the expected answer) is left out; the prompt ends with the generation prompt.
    prompt = sharegpt.prompt_segments({"conversations": SHAREGPT[:3]}, "x:1")
    assert prompt == chat.prompt_segments({"messages": CONVERSATION[:2]}, "x:1")
    assert prompt[0][0].endswith("sort lists<|im_end|>\n<|im_start|>assistant\n")
    assert sharegpt.encode_prompt({"conversations": SHAREGPT[:2]}, "x:1") == chat.encode_prompt(
        {"messages": CONVERSATION[:2]}, "x:1")


BAD_SHAREGPT = {
    "unknown_from": ({"conversations": [SHAREGPT[1], {"from": "bot", "value": "hi"}]},
                     "sg.jsonl:4: conversations[1] has from 'bot', which data.sharegpt_roles does not map; known: "
                     "system, human, user, gpt, assistant, tool, function_call, observation",
                     "add it to data.sharegpt_roles"),
    "missing": ({"messages": []}, "sg.jsonl:4: field 'conversations' must be a non-empty list of {from, value} "
                "turns (it is missing)", None),
    "ill_typed": ({"conversations": [{"from": "human", "value": 3}]},
                  "sg.jsonl:4: conversations[0] needs string fields 'from' and 'value'", None),
    "gpt_first": ({"conversations": [SHAREGPT[2], SHAREGPT[1]]},
                  "sg.jsonl:4: conversations[0] is an assistant turn before any user turn", None),
    "no_reply": ({"conversations": SHAREGPT[:2]}, "sg.jsonl:4: conversations has no assistant turn", None),
}


@pytest.mark.parametrize("case", sorted(BAD_SHAREGPT))
def test_bad_sharegpt_row_is_named(tokenizer, case):
    row, expected, hint = BAD_SHAREGPT[case]
    with pytest.raises(UserError) as info:
        Encoder(tokenizer, "sharegpt", 256, chat_template="chatml").encode(row, "sg.jsonl:4")
    assert expected in str(info.value)
    assert hint is None or hint in str(info.value)


def test_bad_sharegpt_row_fails_validate(make_recipe, tmp_path):
    data = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": SHAREGPT}, BAD_SHAREGPT["unknown_from"][0]])
    code, output = validate(make_recipe(data={"path": str(data), "format": "sharegpt", "chat_template": "chatml"}))
    assert code == 2 and "sg.jsonl:2: conversations[1] has from 'bot'" in output, output
    code, output = validate(make_recipe(data={"path": str(data), "format": "sharegpt", "chat_template": "chatml",
                                              "sharegpt_roles": {"human": "user", "bot": "assistant",
                                                                 "gpt": "assistant", "system": "system"}}))
    assert code == 0, output


# Tokenized rows -----------------------------------------------------------------------------------------------


def test_tokenized_rows_are_used_as_they_are(tokenizer):
    encoder = Encoder(tokenizer, "tokenized", 8)
    with_labels = encoder.encode({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, "t:1")
    assert with_labels.input_ids == [5, 6, 7, 8] and with_labels.labels == [-100, -100, 7, 8]  # no BOS, no EOS
    assert not with_labels.truncated
    with_mask = encoder.encode({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}, "t:1")
    assert (with_mask.input_ids, with_mask.labels) == (with_labels.input_ids, with_labels.labels)
    both = encoder.encode({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "loss_mask": [0, 0, 1, 1]}, "t")
    assert both.labels == with_labels.labels
    long = encoder.encode({"input_ids": list(range(3, 13)), "loss_mask": [1] * 10}, "t:2")
    assert long.truncated and long.input_ids == list(range(3, 11)) and long.labels == list(range(3, 11))


def test_tokenized_truncation_is_counted(tokenizer):
    from gpupoor.data.dataset import tokenize_rows
    from gpupoor.data.loading import Row

    rows = [Row({"input_ids": list(range(3, 13)), "loss_mask": [1] * 10}, "t:1"),
            Row({"input_ids": [3, 4], "loss_mask": [0, 1]}, "t:2")]
    dataset = tokenize_rows(rows, Encoder(tokenizer, "tokenized", 8))
    assert dataset.stats.truncated == 1 and dataset.stats.kept == 2


BAD_TOKENIZED = {
    "no_labels": ({"input_ids": [5, 6]}, "t.jsonl:3: format tokenized needs 'labels'"),
    "lengths": ({"input_ids": [5, 6], "labels": [5]}, "t.jsonl:3: 'labels' has 1 entries but 'input_ids' has 2"),
    "mask_lengths": ({"input_ids": [5, 6], "loss_mask": [1, 1, 0]}, "'loss_mask' has 3 entries"),
    "not_int": ({"input_ids": [5, "6"], "labels": [5, 6]}, "t.jsonl:3: input_ids[1] is '6' (str), not an integer"),
    "float": ({"input_ids": [5, 6.0], "labels": [5, 6]}, "input_ids[1] is 6.0 (float), not an integer"),
    "mask_value": ({"input_ids": [5, 6], "loss_mask": [0, 2]}, "loss_mask[1] is 2; a loss mask holds 0 or 1"),
    "shifted": ({"input_ids": [5, 6, 7], "labels": [6, 7, -100]}, "labels[0] = 6 but input_ids[0] = 5"),
    "disagree": ({"input_ids": [5, 6], "labels": [5, 6], "loss_mask": [0, 1]}, "disagree at token 0"),
    "empty": ({"input_ids": [], "labels": []}, "needs a non-empty list 'input_ids'"),
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENIZED))
def test_bad_tokenized_row_is_named(tokenizer, case):
    row, expected = BAD_TOKENIZED[case]
    with pytest.raises(UserError) as info:
        Encoder(tokenizer, "tokenized", 16).encode(row, "t.jsonl:3")
    assert expected in str(info.value)


def test_tokenized_ids_outside_the_tokenizer_are_refused(tokenizer):
    size = len(tokenizer)
    encoder = Encoder(tokenizer, "tokenized", 16)
    encoder.encode({"input_ids": [0, size - 1], "loss_mask": [1, 1]}, "t:1")
    for bad in (size, -1):
        with pytest.raises(UserError) as info:
            encoder.encode({"input_ids": [5, bad], "loss_mask": [1, 1]}, "t.jsonl:9")
        message = str(info.value)
        assert f"t.jsonl:9: input_ids[1] = {bad} is not a token of this tokenizer" in message
        assert f"len(tokenizer) = {size}" in message and "embedding may have more rows" in message


def test_tokenized_rows_validate(make_recipe, tmp_path):
    good = write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}] * 3)
    code, output = validate(make_recipe(data={"path": str(good), "format": "tokenized"}))
    assert code == 0, output
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [5]}])
    code, output = validate(make_recipe(data={"path": str(bad), "format": "tokenized"}))
    assert code == 2 and "bad.jsonl:2: format tokenized needs 'labels'" in output, output


# Mixtures and tokenized_path in validate ----------------------------------------------------------------------


def mixture(alpaca_file, second: dict) -> dict:
    return {"path": None, "format": "alpaca", "chat_template": "chatml",
            "datasets": [{"path": str(alpaca_file)}, second]}


def test_mixture_checks_each_source_in_its_own_format(make_recipe, tmp_path, alpaca_file):
    sharegpt = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": SHAREGPT}] * 2)
    code, output = validate(make_recipe(data=mixture(alpaca_file, {"path": str(sharegpt), "format": "sharegpt"})))
    assert code == 0, output
    bad = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": SHAREGPT}, BAD_SHAREGPT["unknown_from"][0]])
    code, output = validate(make_recipe(data=mixture(alpaca_file, {"path": str(bad), "format": "sharegpt"})))
    assert code == 2 and "sg.jsonl:2: conversations[1] has from 'bot'" in output, output
    # An alpaca row in a source whose own format is sharegpt: checked as sharegpt, not as data.format.
    code, output = validate(make_recipe(data=mixture(alpaca_file, {"path": str(alpaca_file), "format": "sharegpt"})))
    assert code == 2 and "train.jsonl:1: field 'conversations' must be a non-empty list" in output, output


def test_mixture_errors_name_the_source_key(make_recipe, tmp_path, alpaca_file):
    code, output = validate(make_recipe(data=mixture(alpaca_file, {"path": str(tmp_path / "nope.jsonl")})))
    assert code == 2 and "data.datasets[1].path: data file not found" in output, output
    second = {"path": str(alpaca_file), "eval_path": str(tmp_path / "gone.jsonl")}
    code, output = validate(make_recipe(data=mixture(alpaca_file, second)))
    assert code == 2 and "data.datasets[1].eval_path: data file not found" in output, output


def test_mixture_of_chat_sources_needs_a_template(make_recipe, tmp_path, alpaca_file):
    sharegpt = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": SHAREGPT}] * 2)
    data = {**mixture(alpaca_file, {"path": str(sharegpt), "format": "sharegpt"}), "chat_template": None}
    code, output = validate(make_recipe(data=data))
    assert code == 2 and "data.chat_template is not set" in output and "format sharegpt" in output, output


def test_tokenized_path_must_be_a_directory(make_recipe, tmp_path):
    data = {"path": None, "tokenized_path": str(tmp_path / "tokens")}
    code, output = validate(make_recipe(data=data))
    assert code == 2 and "data.tokenized_path:" in output and "does not exist" in output, output
    (tmp_path / "tokens").write_text("not a directory")
    code, output = validate(make_recipe(data=data))
    assert code == 2 and "is not a directory" in output, output
    (tmp_path / "tokens").unlink()
    (tmp_path / "tokens").mkdir()  # a directory, but not one `gpupoor tokenize` wrote: training refuses it too
    code, output = validate(make_recipe(data=data))
    assert code == 2 and "no manifest.json" in output, output


# validate --show ----------------------------------------------------------------------------------------------


def test_show_prints_rows_as_training_tokenizes_them(make_recipe, tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    recipe = make_recipe(data={"path": str(data), "format": "chat", "chat_template": "chatml", "max_length": 1024})
    code, output = validate(recipe, "--show", "1")
    assert code == 0, output
    encoded = Encoder(tokenizer, "chat", 1024, chat_template="chatml").encode({"messages": CONVERSATION}, "x")
    trained = sum(1 for label in encoded.labels[1:] if label != IGNORE_INDEX)
    header = next(line for line in output.splitlines() if line.startswith("--- data.path "))
    assert header.endswith(f"chat.jsonl:1: {len(encoded.input_ids)} tokens, {trained} trained"), header
    assert ("<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nsort lists<|im_end|>\n"
            "<|im_start|>assistant\n«done quickly<|im_end|>\n»<|im_start|>user\nreverse<|im_end|>\n"
            "<|im_start|>assistant\n«the answer<|im_end|>\n</s>»") in output


def test_show_marks_truncation_and_each_source(make_recipe, tmp_path, alpaca_file):
    sharegpt = write_jsonl(tmp_path / "sg.jsonl", [{"conversations": SHAREGPT}] * 3)
    data = {**mixture(alpaca_file, {"path": str(sharegpt), "format": "sharegpt", "name": "talk"}),
            "max_length": 16}
    code, output = validate(make_recipe(data=data), "--show", "2")
    assert code == 0, output
    headers = [line for line in output.splitlines() if line.startswith("--- ")]
    assert len(headers) == 4, output
    assert headers[0].startswith("--- data.datasets[0] (train) ") and "train.jsonl:1: 16 tokens" in headers[0]
    assert headers[2].startswith("--- data.datasets[1] (talk) ") and "sg.jsonl:1: 16 tokens" in headers[2]
    assert "truncated to data.max_length = 16" in headers[2]
    assert "no trained tokens, so training drops this row" in headers[2]  # the reply is past token 16


def test_mixture_amounts_beyond_a_hundred_passes_are_refused(make_recipe, tmp_path, alpaca_file, tokenizer):
    # rows or epochs of 1e12 passed validate, then grew memory without end building the epoch's order (issue #25):
    # at most 100 passes over a source per epoch, checked by validate against its rows and by training's build.
    from gpupoor.data.build import build_data
    from gpupoor.errors import UserError
    from gpupoor.recipe.loading import load_recipe

    code, output = validate(make_recipe(data=mixture(alpaca_file, {"path": str(alpaca_file), "rows": 10**12})))
    assert code == 2, output
    assert "data.datasets[1].rows: 1,000,000,000,000 examples per epoch is more than 100 passes over the " \
           "source's 48 rows" in output and "at most 4,800" in output, output
    code, output = validate(make_recipe(data=mixture(alpaca_file, {"path": str(alpaca_file), "epochs": 1e12})))
    assert code == 2 and "'data.datasets.1.epochs' = 1000000000000.0: Input should be less than or equal to 100" \
        in output, output
    code, output = validate(make_recipe(data=mixture(alpaca_file, {"path": str(alpaca_file), "rows": 4800})))
    assert code == 0, output
    held_out = {"path": str(alpaca_file), "rows": 4800, "eval_rows": 8}  # 40 rows left to draw from
    code, output = validate(make_recipe(data=mixture(alpaca_file, held_out)))
    assert code == 2 and "passes over the source's 40 rows left after eval_rows" in output, output
    # Training's own check, on the examples it built (a hub source is not counted by validate).
    recipe = load_recipe(make_recipe(data=mixture(alpaca_file, {"path": str(alpaca_file), "rows": 4801}))).recipe
    with pytest.raises(UserError, match=r"data.datasets\[1\].rows: 4,801 examples per epoch is more than 100 "
                                        r"passes over the source's 48 examples"):
        build_data(recipe.data, tokenizer, micro_batch_size=4, seed=0, base_dir=tmp_path)


# Space-prefixing SentencePiece tokenizers --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILY_FORMATS))
def test_a_space_prefixing_tokenizer_gets_the_whole_conversations_ids(sentencepiece_style_tokenizers, name):
    """Tokenized segment by segment, a Llama 2-style tokenizer would start every reply with a ▁ the conversation
    does not have ("\\n" + "done" as "▁done"). The ids are the whole rendered text's, and the trained ones are the
    replies'."""
    tokenizer = sentencepiece_style_tokenizers[True]
    encoder = Encoder(tokenizer, "chat", 1024, chat_template=name)
    assert encoder.whole_text and encoder.cache_settings()["segments"]
    encoded = encoder.encode({"messages": CONVERSATION}, "x:1")
    whole = "".join(text for text, _ in encoder.segments({"messages": CONVERSATION}, "x:1"))
    expected = ([] if whole.startswith("<s>") else [tokenizer.bos_token_id]) + \
        tokenizer(whole, add_special_tokens=False).input_ids
    assert encoded.input_ids[:len(expected)] == expected and len(encoded.input_ids) - len(expected) <= 1  # + EOS
    trained = tokenizer.decode(trained_ids(encoded))
    assert REPLY_1.split()[-1] in trained and REPLY_2.split()[-1] in trained
    assert USER_1.split()[-1] not in trained and "reverse" not in trained and SYSTEM.split()[-1] not in trained
    # Segment by segment, the ids would differ (each segment after the first starting with its own ▁).
    segments = encoder.segments({"messages": CONVERSATION}, "x:1")
    separately = [token for text, _ in segments for token in tokenizer(text, add_special_tokens=False).input_ids]
    assert separately != tokenizer(whole, add_special_tokens=False).input_ids


def test_a_tokenizer_without_a_space_prefix_keeps_segment_by_segment_ids(sentencepiece_style_tokenizers, tokenizer):
    """Byte-level BPE (and Gemma's SentencePiece layout): tokenized per segment as before, and the cache key and the
    data identity checkpoints record do not change."""
    for unprefixed in (sentencepiece_style_tokenizers[False], tokenizer):
        encoder = Encoder(unprefixed, "chat", 1024, chat_template="chatml")
        assert not encoder.whole_text and encoder.cache_settings()["segments"] is None
        segments = encoder.segments({"messages": CONVERSATION}, "x:1")
        assert encoder.segment_ids(segments) == [unprefixed(text, add_special_tokens=False).input_ids
                                                 for text, _ in segments]


def test_split_at_offsets_gives_each_token_to_the_segment_of_its_last_character():
    from gpupoor.data.encoder import split_at_offsets

    # "ab|c d|" : tokens "ab", "c", " d", and an empty third segment.
    assert split_at_offsets([1, 2, 3], [(0, 2), (2, 3), (3, 5)], [2, 3, 0]) == [[1], [2, 3], []]
    assert split_at_offsets([1, 2], [(0, 3), (3, 4)], [2, 2]) == [[], [1, 2]]  # "abc" straddles: the later's


def test_a_prompt_ending_in_a_space_keeps_the_replys_first_word_trained(sentencepiece_style_tokenizers):
    """"A: " + "sort": the whole text's "▁sort" starts at the prompt's space but is the completion's word."""
    tokenizer = sentencepiece_style_tokenizers[True]
    for fmt, row in (("completion", {"prompt": "Q: reverse\nA: ", "completion": "sort lists"}),
                     ("alpaca", {"instruction": "reverse ", "output": "sort lists"})):
        encoded = Encoder(tokenizer, fmt, 256).encode(row, "x:1")
        trained = tokenizer.decode(trained_ids(encoded)).strip()
        assert trained.startswith("sort lists"), (fmt, trained)


def test_the_probe_reads_how_the_tokenizer_prefixes(sentencepiece_style_tokenizers, tokenizer):
    from gpupoor.data.encoder import prefixes_every_input

    assert prefixes_every_input(sentencepiece_style_tokenizers[True])
    assert not prefixes_every_input(sentencepiece_style_tokenizers[False]) and not prefixes_every_input(tokenizer)


def test_the_schemas_format_names_are_the_format_table():
    """One list per fact: a format added to gpupoor.data.row_formats.FORMATS is one the recipe accepts, and no name
    the recipe accepts lacks a class."""
    from typing import get_args

    from gpupoor.data.row_formats import FORMATS
    from gpupoor.recipe.schema import DATA_FORMATS, DataFormat

    assert get_args(DataFormat) == DATA_FORMATS
    assert set(DATA_FORMATS) == set(FORMATS)


def test_a_rows_field_names_are_the_schemas_field_keys():
    """One list per fact: FIELD_KEYS is what a source inherits from `data`, what FieldNames holds under the same
    names, and what the encoder takes; a source's own name wins over `data`'s."""
    from dataclasses import fields

    from gpupoor.data.row_formats import FieldNames
    from gpupoor.recipe.schema import FIELD_KEYS, DataSection, SourceSection

    assert tuple(f.name for f in fields(FieldNames) if f.name != "sharegpt_roles") == FIELD_KEYS
    assert set(FIELD_KEYS) <= set(DataSection.model_fields) & set(SourceSection.model_fields)
    data = DataSection(datasets=[{"path": "a.jsonl", "format": "sharegpt", "conversations_field": "turns"},
                                 {"path": "b.jsonl", "format": "chat"}], messages_field="dialogue")
    first, second = (FieldNames.of(source, data.sharegpt_roles) for source in data.sources())
    assert (first.conversations_field, first.messages_field) == ("turns", "dialogue")
    assert (second.conversations_field, second.messages_field) == ("conversations", "dialogue")
    with pytest.raises(TypeError):  # a name the encoder does not know is not silently dropped
        FieldNames(prompt_field="q")


def test_rows_per_example_are_decided_once_for_data_and_plan():
    """A preference pair is two sequences of up to max_length: the sampler's packed row length and the plan's
    rows both read gpupoor.data.row_formats.sequences_per_example."""
    from gpupoor.data.row_formats import sequences_per_example

    assert sequences_per_example(["preference"]) == 2 and sequences_per_example(["preference", "preference"]) == 2
    assert sequences_per_example(["chat", "preference"]) == 1 and sequences_per_example([]) == 1


def test_the_fields_that_name_a_rows_format_are_the_format_tables():
    """row_fields.FORMAT_FIELDS (the hint "its fields are those of format X") names each format of FORMATS once,
    and a row with exactly one format's fields is recognised as that format."""
    from gpupoor.data.row_formats import FORMATS
    from gpupoor.data.row_fields import FORMAT_FIELDS, format_of_fields

    assert sorted(name for name, _ in FORMAT_FIELDS) == sorted(FORMATS)
    for name, fields in FORMAT_FIELDS:
        row = dict.fromkeys(fields, "x")
        assert format_of_fields(row, "none") == name, name

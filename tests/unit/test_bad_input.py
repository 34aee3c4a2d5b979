"""Bad input gets a clear error (issue #12): what, where (file:line or dotted key), what is allowed, what to do;
raised as a UserError, so the CLI exits 2 with no traceback."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from gpupoor.cli import app
from gpupoor.data.encoder import Encoder
from gpupoor.errors import UserError
from gpupoor.commands.validate import PREFLIGHT_ROWS
from gpupoor.recipe.loading import load_recipe
from support.bad_input import ASSISTANT, LONE, SURROGATE_ROWS, USER, runner, surrogate_recipe


MINIMAL = "model:\n  name_or_path: some/model\ndata:\n  path: train.jsonl\n"  # lines 1-4


def write(tmp_path, text: str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path, overrides: list[str] | None = None) -> str:
    with pytest.raises(UserError) as info:
        load_recipe(path, overrides)
    return str(info.value)


def validate(*paths) -> tuple[int, str]:
    result = runner.invoke(app, ["validate", *map(str, paths)])
    return result.exit_code, result.output


# 1. Bytes that are not UTF-8 -------------------------------------------------------------------------------


def test_recipe_not_utf8_names_line_and_byte_offset(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(MINIMAL.encode() + b"output_dir: caf\xe9\n")  # latin-1 e-acute on line 5
    message = error_of(path)
    offset = len(MINIMAL.encode()) + len(b"output_dir: caf")
    assert f"r.yaml:5: not UTF-8 text: byte 0xe9 at byte offset {offset}" in message
    assert "save the file as UTF-8" in message


BAD_DATA = {
    ".jsonl": b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n',
    ".json": b'[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "caf\xe9", "output": "b"}\n]\n',
    ".csv": b'instruction,output\na,b\ncaf\xe9,b\n',
}
BAD_LINE = {".jsonl": 2, ".json": 3, ".csv": 3}


@pytest.mark.parametrize("key", ["path", "eval_path"])
@pytest.mark.parametrize("suffix", sorted(BAD_DATA))
def test_data_file_not_utf8_names_line_at_validate(make_recipe, alpaca_file, tmp_path, suffix, key):
    bad = tmp_path / f"bad{suffix}"
    bad.write_bytes(BAD_DATA[suffix])
    data = {"path": str(bad)} if key == "path" else {"path": str(alpaca_file), "eval_path": str(bad)}
    code, output = validate(make_recipe(data=data))
    assert code == 2, output
    assert f"bad{suffix}:{BAD_LINE[suffix]}: not UTF-8 text: byte 0xe9 at byte offset" in output
    assert "save the file as UTF-8" in output and "Traceback" not in output


def test_generate_file_not_utf8(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "sort"}\n{"prompt": "caf\xe9"}\n')
    result = runner.invoke(app, ["generate", str(tiny_model), "--file", str(prompts), "--format", "text"])
    assert result.exit_code == 2, result.output
    offset = len(b'{"prompt": "sort"}\n{"prompt": "caf')
    assert f"prompts.jsonl:2: not UTF-8 text: byte 0xe9 at byte offset {offset} (line 2, column 16)" \
        in result.output


def test_validate_checks_the_next_recipe_after_a_non_utf8_one(make_recipe, tmp_path):
    bad = tmp_path / "a.yaml"
    bad.write_bytes(b"model:\n  name_or_path: \xff\n")
    good = make_recipe("b.yaml")
    code, output = validate(bad, good)
    assert code == 2
    assert "a.yaml:2: not UTF-8 text" in output and f"{good}: ok" in output


def test_validate_checks_the_next_recipe_after_a_crash(make_recipe, monkeypatch):
    import gpupoor.commands.validate

    real = gpupoor.commands.validate.preflight

    def crash_on_a(loaded, *args):
        if loaded.source.name == "a.yaml":
            raise RuntimeError("boom")
        return real(loaded, *args)

    monkeypatch.setattr(gpupoor.commands.validate, "preflight", crash_on_a)
    code, output = validate(make_recipe("a.yaml"), make_recipe("b.yaml"))
    assert code == 1 and "a.yaml: error: RuntimeError: boom" in output and "b.yaml: ok" in output


# 2. Chat rows ------------------------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "be brief"}

BAD_CHATS = {
    "assistant_first": ([SYSTEM, ASSISTANT, USER, ASSISTANT],
                        "messages[1] is an assistant turn before any user turn"),
    "no_assistant": ([SYSTEM, USER], "messages has no assistant turn, so there is nothing to train on"),
    "unknown_role": ([USER, {"role": "human", "content": "x"}, ASSISTANT],
                     "messages[1] has role 'human'; allowed: system, user, assistant, tool"),
}


def chat_file(tmp_path, *conversations, name="chat.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return path


@pytest.mark.parametrize("case", sorted(BAD_CHATS))
def test_bad_chat_row_fails_validate(make_recipe, tmp_path, case):
    messages, expected = BAD_CHATS[case]
    data = chat_file(tmp_path, [USER, ASSISTANT], messages)
    code, output = validate(make_recipe(data={"path": str(data), "format": "chat", "chat_template": "chatml"}))
    assert code == 2 and f"chat.jsonl:2: {expected}" in output, output


@pytest.mark.parametrize("case", sorted(BAD_CHATS))
def test_bad_chat_row_fails_training_encoder(tokenizer, case):
    messages, expected = BAD_CHATS[case]
    with pytest.raises(UserError, match="chat.jsonl:7: " + expected.replace("[", r"\[").replace("]", r"\]")):
        Encoder(tokenizer, "chat", 128, chat_template="chatml").encode({"messages": messages}, "chat.jsonl:7")


def test_chat_row_without_assistant_is_fine_with_train_on_prompt(make_recipe, tmp_path, tokenizer):
    data = chat_file(tmp_path, [SYSTEM, USER])
    code, output = validate(make_recipe(data={"path": str(data), "format": "chat", "train_on_prompt": True,
                                              "chat_template": "chatml"}))
    assert code == 0, output
    encoded = Encoder(tokenizer, "chat", 128, train_on_prompt=True, chat_template="chatml").encode(
        {"messages": [SYSTEM, USER]}, "x:1")
    assert len(encoded.input_ids) > 2


def test_tool_role_is_allowed(make_recipe, tmp_path):
    tool = {"role": "tool", "content": "42"}
    data = chat_file(tmp_path, [USER, ASSISTANT, tool, ASSISTANT])
    code, output = validate(make_recipe(data={"path": str(data), "format": "chat", "chat_template": "chatml"}))
    assert code == 0, output


# 2b. Lone surrogates ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(SURROGATE_ROWS))
def test_lone_surrogate_fails_validate_naming_line_and_field(make_recipe, tmp_path, fmt):
    code, output = validate(surrogate_recipe(make_recipe, tmp_path, fmt))
    field = SURROGATE_ROWS[fmt][2]
    assert code == 2, output
    assert f"lone.jsonl:2: {field}: \\ud800 (column " in output and "surrogate pair with no other half" in output
    assert "Traceback" not in output


def test_lone_surrogate_in_a_json_list_names_its_line(make_recipe, tmp_path):
    code, output = validate(surrogate_recipe(make_recipe, tmp_path, "alpaca", ".json"))
    assert code == 2 and "lone.json:3 (item 1): output: \\ud800 (column " in output, output


def test_surrogate_pairs_and_escaped_backslashes_are_text(make_recipe, tmp_path):
    rows = [{"instruction": "smile \U0001F600", "output": "done"},  # json.dumps writes "\ud83d\ude00": one character
            {"instruction": "\\ud800 is six characters", "output": "done"}]  # an escaped backslash, then "ud800"
    path = tmp_path / "fine.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert "\\ud83d\\ude00" in path.read_text() and "\\\\ud800" in path.read_text()
    code, output = validate(make_recipe(data={"path": str(path)}))
    assert code == 0, output


def test_generate_file_with_a_lone_surrogate(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "sort"}) + "\n" + json.dumps({"prompt": LONE}) + "\n")
    result = runner.invoke(app, ["generate", str(tiny_model), "--file", str(prompts), "--format", "text"])
    assert result.exit_code == 2 and "prompts.jsonl:2: prompt: \\ud800 (column 14)" in result.output, result.output


def test_parquet_string_that_is_not_utf8_names_row_and_column(make_recipe, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # b"\xed\xa0\x80" is \ud800 as CESU-8: pyarrow refuses to write it from Python, another writer may not.
    values = b"ab" + b"x\xed\xa0\x80y"
    offsets = pa.py_buffer(bytes([0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 7, 0, 0, 0]))
    output = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(values)])
    pq.write_table(pa.table({"instruction": ["a", "b", "c"], "output": output}), tmp_path / "bad.parquet")
    code, text = validate(make_recipe(data={"path": str(tmp_path / "bad.parquet")}))
    assert code == 2 and "bad.parquet[2]: output: not UTF-8 text: invalid continuation byte" in text, text


# 3. data.chat_template --------------------------------------------------------------------------------------

GOOD_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.tool_calls %}[tools]{% endif %}"
                 "[{{ m['role'] }}]{% if m.role == 'assistant' %}{% generation %}{{ m['content'] }}"
                 "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
BAD_TEMPLATES = {
    "raises": ("{% for m in messages %}{% if m.role == 'assistant' and loop.index0 > 2 %}"
               "{{ raise_exception('only one assistant turn') }}{% endif %}{{ m.content }}{% endfor %}",
               "TemplateError: only one assistant turn"),
    "undefined_name": ("{% for m in messages %}{{ m.content }}{{ end_of_turn }}{% endfor %}",
                       "'end_of_turn' is undefined"),
}


def chat_recipe(make_recipe, tmp_path, template):
    data = chat_file(tmp_path, [USER, ASSISTANT], [USER, ASSISTANT, USER, ASSISTANT])
    return make_recipe(data={"path": str(data), "format": "chat", "chat_template": template})


@pytest.mark.parametrize("case", sorted(BAD_TEMPLATES))
def test_chat_template_that_fails_on_a_row_fails_validate(make_recipe, tmp_path, case):
    template, expected = BAD_TEMPLATES[case]
    code, output = validate(chat_recipe(make_recipe, tmp_path, template))
    assert code == 2, output
    assert "data.chat_template fails on" in output and "chat.jsonl:" in output and expected in output


def test_chat_template_with_a_syntax_error_fails_validate(make_recipe, tmp_path):
    code, output = validate(chat_recipe(make_recipe, tmp_path, "{% for m in messages %}{{ m.content }}"))
    assert code == 2 and "data.chat_template: not a valid Jinja template" in output, output


def test_chat_template_using_special_tokens_and_optional_fields_passes_validate(make_recipe, tmp_path):
    code, output = validate(chat_recipe(make_recipe, tmp_path, GOOD_TEMPLATE))
    assert code == 0, output


def test_chat_template_that_raises_in_training_is_a_user_error(tokenizer):
    template = BAD_TEMPLATES["raises"][0]
    encoder = Encoder(tokenizer, "chat", 128, chat_template=template)
    with pytest.raises(UserError, match=r"chat.jsonl:3: data.chat_template failed on this row .*only one"):
        encoder.encode({"messages": [USER, ASSISTANT, USER, ASSISTANT]}, "chat.jsonl:3")


# 4. Schema: betas, seed, non-finite floats ---------------------------------------------------------------


@pytest.mark.parametrize("betas", ["[0.9, 1.0]", "[-0.1, 0.999]", "[.nan, 0.999]"])
def test_adam_betas_must_be_in_0_1(tmp_path, betas):
    message = error_of(write(tmp_path, MINIMAL + f"training:\n  adam_betas: {betas}\n"))
    assert "r.yaml:6" in message and "'training.adam_betas" in message


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_seed_must_fit_torch_manual_seed(tmp_path, seed):
    message = error_of(write(tmp_path, MINIMAL + f"seed: {seed}\n"))
    assert "r.yaml:5: 'seed'" in message


def test_largest_seed_is_accepted(tmp_path):
    assert load_recipe(write(tmp_path, MINIMAL + f"seed: {2**64 - 1}\n")).recipe.seed == 2**64 - 1


@pytest.mark.parametrize("key", ["training.learning_rate", "training.adam_eps", "training.weight_decay",
                                 "training.max_grad_norm", "training.epochs", "training.warmup_ratio",
                                 "training.momentum", "checkpoint.every_minutes", "peft.alpha", "peft.dropout"])
@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf"])
def test_non_finite_floats_are_schema_errors(tmp_path, key, value):
    section, name = key.split(".")
    message = error_of(write(tmp_path, MINIMAL + f"{section}:\n  {name}: {value}\n"))
    assert f"r.yaml:6: '{key}'" in message, message


def test_non_finite_learning_rate_from_set_is_named(tmp_path):
    message = error_of(write(tmp_path, MINIMAL), ["training.learning_rate=.inf"])
    assert "--set training.learning_rate: 'training.learning_rate' = inf" in message


# 5. YAML alias bombs and huge values ------------------------------------------------------------------------

def laughs(prefix: str = "") -> str:
    """Billion laughs: `a` is 9 strings, `b` 9 `a`s, ... `i` 9**9 strings, in under a kilobyte."""
    lines = [f'{prefix}a: &a ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"{prefix}{chr(c)}: &{chr(c)} [{','.join([f'*{chr(c - 1)}'] * 9)}]" for c in range(ord("b"), ord("j"))]
    return "\n".join(lines) + "\n"


def test_nested_aliases_are_refused_at_the_alias(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + laughs()))
    # With aliases expanded a holds 10 values, b 91, c 820, d 7381: the first *d in e (line 9) crosses 10000
    assert "r.yaml:9: alias *d expands the recipe past 10000 values" in message
    assert "not valid YAML" not in message and len(message) < 1000


def test_nested_aliases_under_a_known_key_are_refused(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "seed:\n" + laughs("  ")))
    assert "r.yaml:10: alias *d expands the recipe past 10000 values" in message and len(message) < 1000


def test_recursive_alias_is_refused(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "output_dir: &o [*o]\n"))
    assert "r.yaml:5: alias *o is inside its own anchor" in message


def test_small_aliases_still_work(tmp_path):
    text = MINIMAL + "peft:\n  dropout: &p 0.1\n  rank: &r 8\ntraining:\n  momentum: *p\n  micro_batch_size: *r\n"
    recipe = load_recipe(write(tmp_path, text)).recipe
    assert recipe.training.momentum == 0.1 and recipe.training.micro_batch_size == 8


def test_aliases_in_set_values_are_bounded(tmp_path):
    value = "[" + ",".join(["&a [1,1,1,1,1,1,1,1,1,1]"] + ["*a"] * 2000) + "]"
    message = error_of(write(tmp_path, MINIMAL), [f"seed={value}"])
    assert "--set seed" in message and "past 10000 values" in message and len(message) < 2000


@pytest.mark.parametrize("value", ['"' + "x" * 1_000_000 + '"', "[" + ",".join(["1"] * 100_000) + "]"])
def test_huge_value_under_a_known_key_gives_a_short_error(tmp_path, value):
    message = error_of(write(tmp_path, MINIMAL + f"training:\n  learning_rate: {value}\n"))
    assert "r.yaml:6: 'training.learning_rate'" in message and len(message) < 2000


def test_many_errors_are_capped(tmp_path):
    """The same error in 5000 items of one list is one line; past MAX_REPORTED_ERRORS different errors, the rest
    are counted, not printed."""
    from gpupoor.recipe.loading import MAX_REPORTED_ERRORS

    items = ",".join(["1"] * 5000)
    message = error_of(write(tmp_path, MINIMAL + f"peft:\n  target_modules: [{items}]\n"))
    assert "items 0, 1, 2, 3, 4, ... (5000 in all): Input should be a valid string" in message
    assert len(message) < 2000
    keys = "".join(f"  unknown_{n}: 1\n" for n in range(MAX_REPORTED_ERRORS + 7))
    message = error_of(write(tmp_path, MINIMAL + f"training:\n{keys}"))
    assert "... and 7 more errors" in message


def test_every_error_is_shown_at_once_in_file_order(tmp_path):
    """A recipe of 30 mistakes gets all 30 (it got 10), in the order of the file's lines; another tool's keys and
    values are told in gpupoor's terms."""
    bad = "".join(f"  unknown_{n}: 1\n" for n in range(26))
    message = error_of(write(tmp_path, "do_train: true\nmodel:\n  name_or_path: some/model\ndata:\n  path: t.jsonl\n"
                             "  eval_rows: 0.1\npeft:\n  target_modules: all\n"
                             f"training:\n{bad}  micro_batch_size: 0\n"))
    lines = [line for line in message.splitlines() if "r.yaml:" in line]
    assert len(lines) == 30, message
    numbers = [int(line.split("r.yaml:")[1].split(":")[0]) for line in lines]
    assert numbers == sorted(numbers)
    assert "unknown key 'do_train'; not needed in gpupoor (gpupoor train trains): remove it" in message
    assert "'peft.target_modules' = 'all': Input should be a valid list or 'all-linear'; LLaMA-Factory's 'all' is " \
        "gpupoor's 'all-linear'" in message
    assert "eval_rows is a number of rows, not a fraction" in message


def test_huge_unknown_key_gives_a_short_error(tmp_path):
    # an explicit key (`? KEY`): YAML caps implicit keys at 1024 characters, not explicit ones
    message = error_of(write(tmp_path, MINIMAL + "training:\n  ? " + "k" * 100_000 + "\n  : 1\n"))
    assert "r.yaml:6: unknown key" in message and len(message) < 2000


# 6. Misleading messages -------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_data_path_is_not_a_regular_file(make_recipe, tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    code, output = validate(make_recipe(data={"path": str(fifo)}))
    assert code == 2 and "data.path:" in output and "is not a regular file" in output and "not found" not in output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_recipe_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "r.yaml")
    assert "r.yaml: not a regular file" in error_of(tmp_path / "r.yaml")


# 7. What validate accepted and train then refused (#25): each is exit 2 at validate, naming the key --------------


def test_last_layers_beyond_the_model_is_refused_at_validate(make_recipe):
    code, output = validate(make_recipe(peft={"rank": 4, "last_layers": 5}))  # the tiny model has 2 layers
    assert code == 2, output
    assert "peft.last_layers = 5 but the model has 2 decoder layers" in output and "at most 2" in output


@pytest.mark.parametrize("key", ["modules_to_save", "target_modules"])
def test_empty_module_name_is_refused_at_validate(make_recipe, key):
    code, output = validate(make_recipe(peft={"rank": 4, key: [""]}))
    assert code == 2, output
    assert f"'peft.{key}' = ['']: an empty module name matches no module" in output


def test_eval_rows_beyond_the_source_are_refused_at_validate(make_recipe, alpaca_file):
    code, output = validate(make_recipe(data={"eval_rows": 48}))  # the file has 48 rows
    assert code == 2, output
    assert f"data.eval_rows = 48 leaves no training rows ({alpaca_file} has 48 rows)" in output
    assert "at most 47" in output


def test_eval_rows_beyond_a_mixture_sources_max_rows_are_refused_at_validate(make_recipe, alpaca_file):
    sources = [{"path": str(alpaca_file)}, {"path": str(alpaca_file), "max_rows": 10, "eval_rows": 10}]
    code, output = validate(make_recipe(data={"path": None, "datasets": sources}))
    assert code == 2, output
    assert "data.datasets[1].eval_rows = 10 leaves no training rows (data.datasets[1].max_rows = 10 keeps 10 rows" \
        in output


def test_eval_rows_that_leave_training_rows_pass_validate(make_recipe):
    code, output = validate(make_recipe(data={"eval_rows": 47}))
    assert code == 0, output


def test_a_tracker_named_twice_is_refused(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "logging:\n  report_to: [tensorboard, mlflow, tensorboard]\n"))
    assert "r.yaml:6: 'logging.report_to'" in message and "tensorboard listed more than once" in message


# 8. A field that is there with the wrong type is not a *missing* field (#25) ---------------------------------------


@pytest.mark.parametrize("fmt, row, said", [
    ("alpaca", {"instruction": "a", "output": None}, "field 'output' is null, expected a string"),
    ("alpaca", {"instruction": "a", "output": 5}, "field 'output' is a number (5), expected a string"),
    ("completion", {"prompt": ["a"], "completion": "b"}, "field 'prompt' is a list, expected a string"),
    ("preference", {"prompt": "a", "chosen": None, "rejected": "b"},
     "field 'chosen' is null, expected a string or a list of messages"),
])
def test_a_present_field_of_the_wrong_type_is_not_missing(make_recipe, tmp_path, fmt, row, said):
    good = {"alpaca": {"instruction": "a", "output": "b"}, "completion": {"prompt": "a", "completion": "b"},
            "preference": {"prompt": "a", "chosen": "b", "rejected": "c"}}[fmt]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    extra = {"training": {"objective": "dpo"}} if fmt == "preference" else {}
    code, output = validate(make_recipe(data={"path": str(bad), "format": fmt}, **extra))
    assert code == 2, output
    assert f"bad.jsonl:2: {said}" in output and "missing" not in output


def test_generate_prompt_of_the_wrong_type_is_not_a_missing_field(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "sort"}\n{"prompt": 5}\n')
    result = runner.invoke(app, ["generate", str(tiny_model), "--file", str(prompts), "--format", "text"])
    assert result.exit_code == 2, result.output
    assert "prompts.jsonl:2: field 'prompt' is a number (5), expected a string" in result.output
    assert "missing" not in result.output


# 9. The same data to train and to evaluate on is warned about (#25) ------------------------------------------------


def test_eval_path_that_is_the_training_file_is_warned(make_recipe, alpaca_file, tmp_path):
    (tmp_path / "link.jsonl").symlink_to(alpaca_file)  # another name for the same file
    code, output = validate(make_recipe(data={"eval_path": str(tmp_path / "link.jsonl")}))
    assert code == 0, output
    assert "warning: data.eval_path: " in output and "train.jsonl is also training data (data.path)" in output
    assert "memorised" in output


def test_a_mixtures_eval_path_that_is_another_sources_file_is_warned(make_recipe, alpaca_file, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text(alpaca_file.read_text())  # the same rows in another file: not the same file
    sources = [{"path": str(alpaca_file), "eval_path": str(other)}, {"path": str(other), "eval_path": str(alpaca_file)}]
    code, output = validate(make_recipe(data={"path": None, "datasets": sources}))
    assert code == 0, output
    assert "warning: data.datasets[0].eval_path:" in output and "is also training data (data.datasets[1].path)" in output
    assert "warning: data.datasets[1].eval_path:" in output and "is also training data (data.datasets[0].path)" in output


def test_a_separate_eval_file_is_not_warned(make_recipe, tmp_path):
    from support.rows import alpaca_rows, write_jsonl

    code, output = validate(make_recipe(data={"eval_path": str(write_jsonl(tmp_path / "eval.jsonl", alpaca_rows(8, 1)))}))
    assert code == 0 and "also training data" not in output, output


def test_eval_split_that_is_the_training_split_is_warned(make_recipe, tmp_path):
    import datasets

    from support.rows import alpaca_rows

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(alpaca_rows(16)),
                          "test": datasets.Dataset.from_list(alpaca_rows(4, 1))}).save_to_disk(str(saved))
    code, output = validate(make_recipe(data={"path": str(saved), "eval_split": "train"}))
    assert code == 0 and "warning: data.eval_split: " in output and "(split train) is also training data" in output
    code, output = validate(make_recipe(data={"path": str(saved), "eval_split": "test"}))
    assert code == 0 and "also training data" not in output, output


# 10. YAML keys that are not names (#41): a list, a mapping, a number, null; exit 2 at the key's line ----------------

@pytest.mark.parametrize("text, line, said", [
    ("? [a, b]\n: 1\n", 5, "a key here is a list, '[a, b]', not a name"),
    ("training:\n  ? [a, b]\n  : 1\n", 6, "a key here is a list, '[a, b]', not a name"),
    ("? {a: 1}\n: 1\n", 5, "a key here is a mapping, '{a: 1}', not a name"),
    ("training:\n  ? {lr: 1}\n  : 1\n", 6, "a key here is a mapping, '{lr: 1}', not a name"),
    ("1: x\n", 5, 'the key 1 is read as a number, not a name: recipe keys are names such as `training:`; '
                  'quote it ("1":)'),
    ("null: x\n", 5, "the key null is read as null, not a name"),
    ("training:\n  null: 3\n", 6, "the key null is read as null, not a name"),
    ("training:\n  7: 3\n", 6, "the key 7 is read as a number, not a name"),
    ("2020-01-01: x\n", 5, "the key 2020-01-01 is read as a date, not a name"),
    ("data:\n  path: t.jsonl\n  sharegpt_roles:\n    yes: user\n", 6, "the key yes is read as a boolean, not a name"),
])
def test_a_key_that_is_not_a_name_is_exit_2_at_its_line(tmp_path, text, line, said):
    base = "model:\n  name_or_path: some/model\n" if text.startswith("data:") else MINIMAL  # (text's own data:)
    where = f"r.yaml:{line}: "
    path = write(tmp_path, base + text)
    message = error_of(path)
    assert where + said in message and "not valid YAML" not in message, message
    code, output = validate(path)
    assert code == 2 and where + said in output and "Traceback" not in output, output


def test_a_yaml_merge_key_merges_and_its_overrides_are_no_duplicates(tmp_path):
    """`<<: *anchor` was "not valid YAML" (the duplicate-key check constructed the merge key itself)."""
    text = ("model:\n  name_or_path: some/model\ndata:\n  datasets:\n    - &first {path: a.jsonl, format: alpaca}\n"
            "    - <<: *first\n      path: b.jsonl\n")
    data = load_recipe(write(tmp_path, text)).recipe.data
    assert [(s.path, s.format) for s in data.datasets] == [("a.jsonl", "alpaca"), ("b.jsonl", "alpaca")]


# 11. validate reads a small source whole; of a big one it says how much it read (#41) ------------------------------

def rows_with_a_bad_one_after_the_preflight(tmp_path):
    from support.rows import alpaca_rows, write_jsonl

    return write_jsonl(tmp_path / "rows.jsonl", alpaca_rows(PREFLIGHT_ROWS) + [{"instruction": "x", "output": 5}])


def test_validate_finds_a_bad_row_past_the_first_200_of_a_small_file(make_recipe, tmp_path):
    data = rows_with_a_bad_one_after_the_preflight(tmp_path)
    code, output = validate(make_recipe(data={"path": str(data)}))
    assert code == 2 and f"rows.jsonl:{PREFLIGHT_ROWS + 1}: " in output and "output" in output, output


def test_validate_says_it_read_only_the_first_rows_of_a_big_file(make_recipe, tmp_path, monkeypatch):
    data = rows_with_a_bad_one_after_the_preflight(tmp_path)
    monkeypatch.setattr("gpupoor.commands.validate.WHOLE_CHECK_BYTES", 1024)  # the file is ~10 KiB: "big"
    code, output = validate(make_recipe(data={"path": str(data), "eval_path": str(data)}))
    assert code == 0, output
    for key in ("data.path", "data.eval_path"):
        said = f"recipe.yaml: note: {key}: checked the first {PREFLIGHT_ROWS} rows of {data} ("
        note = next((line for line in output.splitlines() if said in line), output)
        assert note.endswith("): training checks every other row as it reads it"), output


# 12. Standard input that is not text (#41): generate exits 2 naming <stdin>:LINE; chat says so and goes on -----------

@pytest.mark.parametrize("piped, said", [
    (b"sort this\ncaf\xe9 au lait\n", "<stdin>:2: not UTF-8 text: byte 0xe9 at byte 4 of the line"),
    (b'{"prompt": "sort"}\n\n{"prompt": "caf\xe9"}\n', "<stdin>:3: not UTF-8 text: byte 0xe9 at byte 16 of the line"),
    (b"sort this\nfine\nbinary\x00data\n", "<stdin>:3: a NUL byte at byte 7 of the line: binary data, not text"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "<stdin>:1: not UTF-8 text: byte 0x89 at byte 1 of the line"),
])
def test_generate_names_the_stdin_line_that_is_not_text(tiny_model, piped, said):
    result = runner.invoke(app, ["generate", str(tiny_model), "--format", "text", "--max-new-tokens", "2"],
                           input=piped)
    assert result.exit_code == 2 and said in result.output, result.output
    assert "Traceback" not in result.output and "TypeError" not in result.output


@pytest.mark.parametrize("row, said", [({"prompt": 5}, "<stdin>:2: field 'prompt' is a number (5), expected a string"),
                                       ({"prompt": LONE}, "<stdin>:2: prompt: \\ud800 (column 14)")])
def test_errors_in_rows_on_stdin_name_stdin_not_a_temporary_file(tiny_model, row, said):
    piped = json.dumps({"prompt": "sort"}) + "\n" + json.dumps(row) + "\n"
    for where in ([], ["--file", "-"]):
        result = runner.invoke(app, ["generate", str(tiny_model), "--format", "text", "--max-new-tokens", "2", *where],
                               input=piped)
        assert result.exit_code == 2 and said in result.output, result.output
        assert "tmp" not in result.output and "stdin.jsonl" not in result.output, result.output


def test_chat_says_what_is_wrong_with_a_line_and_goes_on(tiny_model):
    session = b"first\ncaf\xe9\nbinary\x00\nsecond\n/exit\n"
    result = runner.invoke(app, ["chat", str(tiny_model), "--max-new-tokens", "2"], input=session)
    assert result.exit_code == 0, result.output
    assert "(<stdin>:2: not UTF-8 text: byte 0xe9 at byte 4 of the line (unexpected end of data); it was not sent: " \
           "type it again)" in result.output
    assert "(<stdin>:3: a NUL byte at byte 7 of the line: binary data, not text; it was not sent" in result.output
    assert result.output.count("model> ") == 2  # first and second answered: the session went on


@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "-inf", "400d"])
def test_plan_time_limit_that_is_no_duration_is_refused_as_train_refuses_it(make_recipe, value):
    """`plan --time-limit inf` (or 1e400) exited 1 with an OverflowError where train gave exit 2."""
    recipe = make_recipe()
    plan = runner.invoke(app, ["plan", str(recipe), f"--time-limit={value}"])
    assert plan.exit_code == 2 and "--time-limit" in plan.output, plan.output
    assert "Traceback" not in plan.output and "OverflowError" not in plan.output
    train = runner.invoke(app, ["train", str(recipe), f"--time-limit={value}", "--output-dir",
                                str(recipe.parent / "never")])
    assert train.exit_code == 2 and "--time-limit" in train.output, train.output
    assert not (recipe.parent / "never").exists()


@pytest.mark.parametrize("value", ["9" * 400, "2000000TiB"])
def test_a_size_past_any_machine_is_refused(value):
    from gpupoor.units import parse_size

    with pytest.raises(UserError, match="--memory .*more than any machine has"):
        parse_size(value, "--memory")

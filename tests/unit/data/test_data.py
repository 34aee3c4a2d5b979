"""Formats, masking, file readers, the tokenization cache and the samplers."""

from __future__ import annotations

import json

import pytest

from support.rows import alpaca_rows, write_jsonl
from gpupoor.data.build import build_data, collate, count_targets
from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.data.encoder import Encoder
from gpupoor.data.row_formats import alpaca_prompt
from gpupoor.data.loading import read_rows, resolve_source
from gpupoor.data.sampler import BatchPlan
from gpupoor.errors import UserError
from gpupoor.recipe.schema import DataSection


def encoder(tokenizer, fmt="alpaca", max_length=256, **kw):
    return Encoder(tokenizer, fmt, max_length, **kw)


def trained(ids, labels):
    return [i for i, label in zip(ids, labels) if label != IGNORE_INDEX]


def test_alpaca_trains_on_output_and_eos_only(tokenizer):
    row = {"instruction": "sort the lists", "input": "small data", "output": "done quickly"}
    encoded = encoder(tokenizer).encode(row, "x:1")
    prompt_ids = tokenizer(alpaca_prompt("sort the lists", "small data"), add_special_tokens=False).input_ids
    output_ids = tokenizer("done quickly", add_special_tokens=False).input_ids
    assert encoded.input_ids[0] == tokenizer.bos_token_id  # this tokenizer adds BOS by default
    assert encoded.input_ids == [tokenizer.bos_token_id] + prompt_ids + output_ids + [tokenizer.eos_token_id]
    assert trained(encoded.input_ids, encoded.labels) == output_ids + [tokenizer.eos_token_id]


def test_train_on_prompt_trains_everything_but_bos(tokenizer):
    row = {"instruction": "sort", "output": "done"}
    encoded = encoder(tokenizer, train_on_prompt=True).encode(row, "x:1")
    assert trained(encoded.input_ids, encoded.labels) == encoded.input_ids[1:]


def test_text_format_trains_the_whole_text(tokenizer):
    encoded = encoder(tokenizer, "text").encode({"text": "the model learns"}, "x:1")
    ids = tokenizer("the model learns", add_special_tokens=False).input_ids
    assert trained(encoded.input_ids, encoded.labels) == ids + [tokenizer.eos_token_id]


def test_chat_format_trains_only_assistant_turns(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort lists"},
                {"role": "assistant", "content": "done quickly"}, {"role": "user", "content": "reverse"},
                {"role": "assistant", "content": "the answer"}]
    enc = encoder(tokenizer, "chat", chat_template="chatml")
    encoded = enc.encode({"messages": messages}, "x:1")
    text = tokenizer.decode(trained(encoded.input_ids, encoded.labels))
    # ChatML: each assistant turn's content and its end marker are trained, nothing else.
    assert text == "done quickly<|im_end|>\nthe answer<|im_end|>\n</s>"
    full = tokenizer.decode(encoded.input_ids)
    assert full.startswith("<s><|im_start|>system\nbe brief<|im_end|>")


def test_chat_template_from_recipe_overrides(tokenizer):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    encoded = encoder(tokenizer, "chat", chat_template=template).encode(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, "x:1")
    assert tokenizer.decode(trained(encoded.input_ids, encoded.labels)) == "hello</s>"


def test_truncation_is_counted_and_empty_targets_dropped(tokenizer):
    from gpupoor.data.dataset import tokenize_rows
    from gpupoor.data.loading import Row

    rows = [Row({"instruction": "sort", "output": "done " * 40}, "a:1"),  # truncated, still has targets
            Row({"instruction": "sort " * 60, "output": "done"}, "a:2"),  # prompt fills max_length: dropped
            Row({"instruction": "sort", "output": "done"}, "a:3")]
    dataset = tokenize_rows(rows, encoder(tokenizer, max_length=64))
    assert dataset.stats.truncated == 1 and dataset.stats.dropped_no_target == 1 and len(dataset) == 2
    assert max(dataset.lengths) == 64


def test_missing_field_names_file_line_and_field(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "a"}])
    rows = read_rows(resolve_source(str(path), tmp_path, "train", "data.path"))
    with pytest.raises(UserError, match=r"d.jsonl:2: missing field 'output'"):
        for row in rows:
            encoder(tokenizer).encode(row.fields, row.where)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(UserError, match=r"d.jsonl:2: not valid JSON"):
        read_rows(resolve_source(str(path), tmp_path, "train", "data.path"))


def test_missing_data_file_names_the_key(tmp_path):
    with pytest.raises(UserError, match="data.path: data file not found"):
        resolve_source("nope.jsonl", tmp_path, "train", "data.path")


def test_json_csv_parquet_and_saved_dataset_read_the_same_rows(tmp_path):
    import datasets

    rows = alpaca_rows(5)
    for row in rows:
        row.setdefault("input", "")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_csv(tmp_path / "d.csv", index=False)
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "d.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "saved")
    for name in ("d.json", "d.csv", "d.parquet", "saved"):
        got = [r.fields for r in read_rows(resolve_source(name, tmp_path, "train", "data.path"))]
        assert got == rows, name


def test_tokenized_cache_hits_and_keys_on_settings(tmp_path, tokenizer, alpaca_file):
    section = DataSection(path=str(alpaca_file), format="alpaca", max_length=64, cache_dir=str(tmp_path / "c"))
    first = build_data(section, tokenizer, micro_batch_size=4, seed=0, base_dir=tmp_path)
    second = build_data(section, tokenizer, micro_batch_size=4, seed=0, base_dir=tmp_path)
    assert not first.cache_hit and second.cache_hit
    assert first.train.ids.tolist() == second.train.ids.tolist()
    longer = build_data(section.model_copy(update={"max_length": 65}), tokenizer, micro_batch_size=4, seed=0, base_dir=tmp_path)
    assert not longer.cache_hit
    alpaca_file.write_text(alpaca_file.read_text() + json.dumps({"instruction": "x", "output": "y"}) + "\n")
    assert not build_data(section, tokenizer, micro_batch_size=4, seed=0, base_dir=tmp_path).cache_hit  # the data bytes changed


def test_eval_rows_are_held_out(tmp_path, tokenizer, alpaca_file):
    section = DataSection(path=str(alpaca_file), format="alpaca", max_length=256, eval_rows=8)
    bundle = build_data(section, tokenizer, micro_batch_size=4, seed=0, base_dir=tmp_path)
    assert len(bundle.eval) == 8 and len(bundle.train) == 40
    train_examples = {tuple(bundle.train[i][0].tolist()) for i in range(len(bundle.train))}
    assert not any(tuple(bundle.eval[i][0].tolist()) in train_examples for i in range(len(bundle.eval)))


def test_collate_pads_and_masks(tmp_path, tokenizer, alpaca_file):
    bundle = build_data(DataSection(path=str(alpaca_file), format="alpaca", max_length=64), tokenizer, micro_batch_size=4, seed=0, base_dir=tmp_path)
    batch = collate(bundle.train, [0, 1, 2], tokenizer.pad_token_id)
    lengths = [bundle.train.lengths[i] for i in (0, 1, 2)]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert count_targets(batch) == sum(int(bundle.train.target[bundle.train.offsets[i] + 1:bundle.train.offsets[i + 1]].sum())
                                       for i in (0, 1, 2))


@pytest.mark.parametrize("kind", ["random", "length_grouped"])
def test_batch_plan_is_a_function_of_seed_and_epoch(kind):
    lengths = [(i * 37) % 101 + 1 for i in range(203)]
    plan = BatchPlan(lengths, 4, seed=3, kind=kind)
    epoch0 = plan.epoch(0)
    assert epoch0 == BatchPlan(lengths, 4, seed=3, kind=kind).epoch(0)  # deterministic
    assert epoch0 != plan.epoch(1) and epoch0 != BatchPlan(lengths, 4, seed=4, kind=kind).epoch(0)
    assert sorted(i for batch in epoch0 for i in batch) == list(range(203))  # each example once
    assert len(epoch0) == len(plan) == 51


def test_length_grouped_cuts_padding():
    lengths = [(i * 37) % 101 + 1 for i in range(400)]

    def padding(kind):
        return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b)
                   for b in BatchPlan(lengths, 8, 0, kind).epoch(0))

    assert padding("length_grouped") < 0.2 * padding("random")


def test_eval_split_of_a_saved_dataset(tmp_path, tokenizer):
    import datasets

    rows = alpaca_rows(12)
    for row in rows:
        row.setdefault("input", "")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:8]),
                          "test": datasets.Dataset.from_list(rows[8:])}).save_to_disk(tmp_path / "saved")
    section = DataSection(path="saved", format="alpaca", max_length=256, eval_split="test")
    bundle = build_data(section, tokenizer, micro_batch_size=4, seed=0, base_dir=tmp_path)
    assert len(bundle.train) == 8 and len(bundle.eval) == 4
    with pytest.raises(UserError, match="no split 'validation'"):
        build_data(section.model_copy(update={"eval_split": "validation"}), tokenizer, micro_batch_size=4, seed=0, base_dir=tmp_path)


def test_completion_format_joins_prompt_and_completion(tokenizer):
    encoded = encoder(tokenizer, "completion").encode({"prompt": "sort the lists\n", "completion": "done"}, "x:1")
    prompt = tokenizer("sort the lists\n", add_special_tokens=False).input_ids
    answer = tokenizer("done", add_special_tokens=False).input_ids
    assert encoded.input_ids == [tokenizer.bos_token_id] + prompt + answer + [tokenizer.eos_token_id]
    assert trained(encoded.input_ids, encoded.labels) == answer + [tokenizer.eos_token_id]
    with pytest.raises(UserError, match="x:2: missing field 'completion'"):
        encoder(tokenizer, "completion").encode({"prompt": "a"}, "x:2")

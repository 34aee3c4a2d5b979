"""Streamed, batched, parallel tokenization; the memory-mapped cache; `gpupoor tokenize` and data.tokenized_path."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from support.cli import invoke
from support.rows import alpaca_rows, sentence as _sentence, write_jsonl
from gpupoor.data import tokenize as tokenize_module
from gpupoor.data.dataset import (CacheEntryInvalid, Chunk, DatasetWriter, TokenizedDataset, TokenStats,
                                  concat_datasets, tokenize_rows)
from gpupoor.data.encoder import Encoder
from gpupoor.data.loading import DataSource, Row, iter_rows, read_rows
from gpupoor.data.tokenize import (encode_rows, load_tokenized_dir, stream_tokenize, tokenize_source,
                                   write_tokenized_dir)
from gpupoor.errors import UserError
from support.tokenize import mixture_recipe


words = _sentence  # random words from the test vocabulary


def format_rows(fmt: str, count: int = 23) -> list[dict]:
    """Rows of a format, with a few that max_length=48 truncates and a few it leaves nothing to train on."""
    rng = random.Random(fmt)
    rows = []
    for index in range(count):
        long = index % 7 == 3  # a prompt past max_length: dropped
        prompt, answer = words(rng, 40, 50) if long else words(rng, 1, 8), words(rng, 1, 30 if index % 5 else 60)
        if fmt == "text":
            rows.append({"text": answer if index % 4 else ""})  # an empty text: only EOS is trained
        elif fmt == "alpaca":
            rows.append({"instruction": prompt, "output": answer, **({"input": words(rng, 1, 5)} if index % 2 else {})})
        elif fmt == "completion":
            rows.append({"prompt": prompt + "\n", "completion": answer})
        elif fmt == "chat":
            turns = [{"role": "system", "content": "be brief"}] if index % 3 == 0 else []
            turns += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            if index % 2:
                turns += [{"role": "user", "content": words(rng, 1, 4)}, {"role": "assistant", "content": "done"}]
            rows.append({"messages": turns})
        elif fmt == "sharegpt":
            rows.append({"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]})
        else:  # tokenized: ids and labels as they are
            ids = [rng.randrange(5, 300) for _ in range(rng.randint(3, 60))]
            rows.append({"input_ids": ids, "labels": [-100 if i < len(ids) // 3 else t for i, t in enumerate(ids)]})
    return rows


BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
# name -> (format, chat template, a max_length that truncates some rows and drops some with the fixture tokenizer)
CASES = {"text": ("text", None, 48), "alpaca": ("alpaca", None, 48), "completion": ("completion", None, 48),
         "chat-chatml": ("chat", "chatml", 96), "chat-llama3": ("chat", "llama3", 160),
         "chat-phi3": ("chat", "phi3", 96), "chat-mistral": ("chat", "mistral", 48),
         "chat-writes-bos": ("chat", BOS_TEMPLATE, 48), "sharegpt": ("sharegpt", "chatml", 96),
         "tokenized": ("tokenized", None, 48)}


def make_encoder(tokenizer, case: str, max_length: int | None = None, **kw) -> tuple[Encoder, list[Row]]:
    fmt, template, length = CASES[case]
    rows = [Row(fields, f"rows.jsonl:{n}") for n, fields in enumerate(format_rows(fmt), 1)]
    return Encoder(tokenizer, fmt, max_length or length, chat_template=template, **kw), rows


def examples(dataset: TokenizedDataset) -> list[tuple[list[int], list[int]]]:
    return [(ids.tolist(), labels.tolist()) for ids, labels in (dataset[i] for i in range(len(dataset)))]


@pytest.mark.parametrize("train_on_prompt", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_batched_streamed_tokenization_equals_one_by_one(tokenizer, case, train_on_prompt, tmp_path, monkeypatch):
    """Every format: one tokenizer call per chunk, chunks in two worker processes, written to a mapped file, gives
    the examples Encoder.encode gives row by row, token for token and label for label, with the same stats."""
    encoder, rows = make_encoder(tokenizer, case, train_on_prompt=train_on_prompt)
    expected = [encoder.encode(row.fields, row.where) for row in rows]
    calls = []
    encode = encoder.encode
    encoder.encode = lambda fields, where: calls.append(where) or encode(fields, where)
    assert encode_rows(rows, encoder) == expected
    # The batched path checks its first row against Encoder.encode; `tokenized` rows are encoded one by one.
    assert len(calls) == (len(rows) if case == "tokenized" else 1)
    del encoder.encode
    reference = tokenize_rows(rows, encoder)
    if case not in ("text", "tokenized") and not train_on_prompt:
        assert 0 < len(reference) < len(rows)  # prompts past max_length leave nothing to train on
    assert reference.stats.truncated > 0
    monkeypatch.setattr(tokenize_module, "CHUNK_ROWS", 4)  # six chunks: the first here, the rest in the pool
    streamed = stream_tokenize(iter(rows), encoder, tmp_path / "entry.safetensors", workers=2)
    assert examples(streamed) == examples(reference)
    assert streamed.stats == reference.stats and streamed.lengths == reference.lengths
    kept = [(e.input_ids, e.labels) for e in expected if any(label != -100 for label in e.labels[1:])]
    assert examples(streamed) == kept


def test_a_batched_chunk_that_differs_from_encode_falls_back_to_it(tokenizer, monkeypatch):
    encoder, rows = make_encoder(tokenizer, "alpaca")
    wrong = tokenize_module.assemble

    def assemble(*args):
        encoded = wrong(*args)
        encoded.input_ids[-1] += 1
        return encoded

    monkeypatch.setattr(tokenize_module, "assemble", assemble)  # as if formats.py changed under the copy
    assert encode_rows(rows, encoder) == [encoder.encode(row.fields, row.where) for row in rows]


def test_a_row_error_in_a_worker_names_the_row(tokenizer, tmp_path, monkeypatch):
    encoder, rows = make_encoder(tokenizer, "alpaca")
    rows[17] = Row({"instruction": "x"}, "rows.jsonl:18")
    monkeypatch.setattr(tokenize_module, "CHUNK_ROWS", 4)
    with pytest.raises(UserError, match="rows.jsonl:18: missing field 'output'"):
        stream_tokenize(iter(rows), encoder, tmp_path / "entry.safetensors", workers=2)
    assert not list(tmp_path.iterdir())  # no entry, no temporary files left behind


def test_progress_line_for_long_sources(tokenizer, tmp_path, monkeypatch, capsys):
    encoder, rows = make_encoder(tokenizer, "alpaca")
    monkeypatch.setattr(tokenize_module, "PROGRESS_AFTER_ROWS", 10)
    stream_tokenize(iter(rows), encoder, None, "rows.jsonl", workers=1)
    assert "tokenizing rows.jsonl: 23 rows" in capsys.readouterr().err
    monkeypatch.setattr(tokenize_module, "PROGRESS_AFTER_ROWS", 50)
    stream_tokenize(iter(rows), encoder, None, "rows.jsonl", workers=1)
    assert capsys.readouterr().err == ""


def big_dataset(path: Path, tokens: int = 8_000_000, length: int = 200) -> TokenizedDataset:
    """A dataset of `tokens` tokens written chunk by chunk, as tokenization writes it."""
    with DatasetWriter(path) as writer:
        for start in range(0, tokens, 1_000_000):
            ids = (np.arange(start, start + 1_000_000) % 50_000).astype(np.int32)
            writer.add(Chunk(ids, (ids % 3 == 0).astype(np.uint8), np.full(1_000_000 // length, length), TokenStats()))
        return writer.finish()


def resident_kib(kind: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(kind)).split()[1])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_the_cache_is_memory_mapped(tmp_path):
    """The loaded tensors live in a mapping of the cache file (not in this process's anonymous memory), and
    reading every example does not copy the tokens into anonymous memory."""
    path = tmp_path / "entry.safetensors"
    big_dataset(path)
    dataset = TokenizedDataset.load(path)
    address = dataset.ids.data_ptr()
    mappings = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    owner = next(m for m in mappings if int(m[0].split("-")[0], 16) <= address < int(m[0].split("-")[1], 16))
    assert owner[-1] == str(path)
    dataset.save(tmp_path / "copy.safetensors")  # once first: what the first save allocates for good
    # Anonymous memory from here on: what the load's and first save's bookkeeping took (a few MiB, more or less
    # with the heap the earlier tests in this worker left) is not the reading this test is about.
    before = resident_kib("RssAnon")
    resident = resident_kib("VmRSS")
    dataset.save(tmp_path / "copy.safetensors")  # a scan of every token reads the file, it does not map it in
    assert resident_kib("VmRSS") - resident < 12_000
    total = sum(int(dataset[i][1].ne(-100).sum()) for i in range(0, len(dataset), 1))
    assert total == int(dataset.target.sum())
    grown = resident_kib("RssAnon") - before
    assert grown < 12_000, f"anonymous memory grew by {grown} KiB reading a 40 MB mapped dataset"
    # Any safetensors reader opens it.
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        assert torch.equal(handle.get_tensor("offsets"), dataset.offsets)
        assert json.loads(handle.metadata()["stats"]) == dataset.stats.__dict__


def test_views_of_a_mapped_dataset_save_and_hash_as_copies_would(tmp_path, tokenizer):
    encoder, rows = make_encoder(tokenizer, "alpaca", max_length=256)
    first = stream_tokenize(iter(rows), encoder, tmp_path / "a.safetensors")
    second = stream_tokenize(iter(rows[:9]), encoder, tmp_path / "b.safetensors")
    view = concat_datasets([first.subset([5, 0, 7]), second, first.subset([2])])
    expected = [first[5], first[0], first[7]] + [second[i] for i in range(len(second))] + [first[2]]
    assert examples(view) == [(i.tolist(), l.tolist()) for i, l in expected]
    view.save(tmp_path / "view.safetensors")
    saved = TokenizedDataset.load(tmp_path / "view.safetensors")
    assert examples(saved) == examples(view) and saved.content_hash() == view.content_hash()
    copy = TokenizedDataset(view.ids, view.target, view.offsets, view.stats)  # flat, in memory
    assert copy.content_hash() == view.content_hash()


@pytest.mark.parametrize("damage", ["ids", "offsets", "truncated", "header", "empty"])
def test_a_damaged_cache_entry_is_a_miss(tmp_path, tokenizer, alpaca_file, damage):
    encoder = Encoder(tokenizer, "alpaca", 128)
    source = DataSource("file", str(alpaca_file), "train")
    entry = tmp_path / "cache" / "entry.safetensors"
    warnings: list[str] = []
    fresh, hit = tokenize_source(source, None, encoder, tokenizer, entry, warnings)
    assert not hit and not warnings
    data = bytearray(entry.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    if damage == "ids":
        data[header + 8 * (len(fresh) + 1) + 13] ^= 1
    elif damage == "offsets":
        data[header + 8] ^= 1
    elif damage == "header":
        data[20] ^= 0x20
    entry.unlink()  # a new file: the dataset above maps the old one
    entry.write_bytes(b"" if damage == "empty" else bytes(data[:-3] if damage == "truncated" else data))
    with pytest.raises(CacheEntryInvalid):
        TokenizedDataset.load(entry)
    again, hit = tokenize_source(source, None, encoder, tokenizer, entry, warnings)
    assert not hit and len(warnings) == 1 and "is invalid" in warnings[0]
    assert examples(again) == examples(fresh)
    third, hit = tokenize_source(source, None, encoder, tokenizer, entry, warnings)
    assert hit and len(warnings) == 1 and examples(third) == examples(fresh)
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]  # no temporary files left


@pytest.mark.parametrize("entry", ["file/entry.safetensors", "file/tokenized/entry.safetensors"])
def test_an_unwritable_cache_is_a_warning(tmp_path, tokenizer, alpaca_file, entry):
    # "file/tokenized": mkdir says "Not a directory"; "file" itself as the entry's folder: "File exists".
    blocker = tmp_path / "file"
    blocker.write_text("")
    warnings: list[str] = []
    source, encoder = DataSource("file", str(alpaca_file), "train"), Encoder(tokenizer, "alpaca", 128)
    dataset, hit = tokenize_source(source, None, encoder, tokenizer, tmp_path / entry, warnings)
    assert not hit and len(dataset) == 48 and "could not write the tokenized cache" in warnings[0]
    assert f"({blocker} is a file, not a directory: remove it, or set data.cache_dir or $GPUPOOR_CACHE" \
        in warnings[0], warnings[0]


@pytest.mark.parametrize("change", [-3, 5])
def test_a_cache_entry_of_the_wrong_length_says_which_way(tmp_path, tokenizer, alpaca_file, change):
    entry = tmp_path / "entry.safetensors"
    tokenize_source(DataSource("file", str(alpaca_file), "train"), None, Encoder(tokenizer, "alpaca", 128),
                    tokenizer, entry, [])
    data = entry.read_bytes()
    entry.unlink()
    entry.write_bytes(data[:change] if change < 0 else data + b"\0" * change)
    with pytest.raises(CacheEntryInvalid) as info:
        TokenizedDataset.load(entry)
    what = "truncated" if change < 0 else "longer than its tensors"
    assert str(info.value) == f"the file is {len(data) + change} bytes, its header describes {len(data)}: {what}"


def test_rows_stream_from_every_reader(tmp_path, monkeypatch):
    import datasets

    from gpupoor.data import loading

    rows = alpaca_rows(7)
    for row in rows:
        row.setdefault("input", "")
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved")
    write_jsonl(tmp_path / "d.jsonl", rows)
    monkeypatch.setattr(loading, "PARQUET_BATCH_ROWS", 2)  # rows cross batch boundaries
    for name in ("d.parquet", "saved", "d.jsonl"):
        source = DataSource("disk" if name == "saved" else "file", str(tmp_path / name), "train")
        stream = iter_rows(source, 5)
        assert next(stream).fields == rows[0]  # a generator: nothing read past what is asked for
        assert [r.fields for r in read_rows(source)] == rows and len(read_rows(source, 5)) == 5


# ---------------------------------------------------------------------------------------------------------------
# gpupoor tokenize and data.tokenized_path


@pytest.mark.parametrize("kind", ["single", "mixture"])
def test_tokenize_writes_a_verified_directory_with_the_examples_of_the_raw_data(make_recipe, mixture_recipe,
                                                                                tmp_path, tokenizer, kind):
    from gpupoor.data.build import build_data
    from gpupoor.recipe.loading import load_recipe

    recipe = make_recipe("single.yaml", data={"eval_rows": 8}) if kind == "single" else mixture_recipe
    out = tmp_path / "tokenized"
    result = invoke("tokenize", recipe, "--output", out)
    assert result.exit_code == 0, result.output
    assert "training examples" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["eval.safetensors", "train.safetensors"]
    from gpupoor.storage.files import sha256_file

    for name, entry in manifest["files"].items():
        assert entry == {"size": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
    recipe_data = load_recipe(recipe).recipe
    raw = build_data(recipe_data.data, tokenizer, micro_batch_size=4, seed=recipe_data.seed, base_dir=tmp_path)
    train, evaluation, manifest = load_tokenized_dir(out, tokenizer)
    assert examples(train) == examples(raw.train) and examples(evaluation) == examples(raw.eval)
    assert manifest["data_fingerprint"] == raw.fingerprint and manifest["max_length"] == 128
    assert [s["name"] for s in manifest["mixture"]["sources"]] == raw.mixture.names
    assert manifest["source_stats"] == [s.__dict__ for s in raw.source_stats]
    mixture = tokenize_module.manifest_mixture(manifest, 0)
    places = [[(s.start, s.end, s.count) for s in m.sources] for m in (mixture, raw.mixture)]
    assert places[0] == places[1]
    again = invoke("tokenize", recipe, "--output", out)  # an earlier output is replaced
    assert again.exit_code == 0, again.output
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tokenized")]


def test_load_tokenized_dir_rejects_a_flipped_byte_and_another_tokenizer(make_recipe, tmp_path, tokenizer):
    from gpupoor.model.tiny import train_tokenizer

    out = tmp_path / "tokenized"
    assert invoke("tokenize", make_recipe(), "--output", out).exit_code == 0
    other = train_tokenizer(["completely different words " * 20, "other text here"], vocab_size=300)
    with pytest.raises(UserError, match=r"another tokenizer \(vocab_size 400 there, \d+ here"):
        load_tokenized_dir(out, other)
    data = bytearray((out / "train.safetensors").read_bytes())
    data[len(data) // 2] ^= 1
    (out / "train.safetensors").write_bytes(bytes(data))
    with pytest.raises(UserError, match="train.safetensors does not match .*manifest.json"):
        load_tokenized_dir(out, tokenizer)
    (out / "manifest.json").unlink()
    with pytest.raises(UserError, match="not a directory `gpupoor tokenize` wrote"):
        load_tokenized_dir(out, tokenizer)


def test_tokenize_refuses_to_replace_a_directory_it_did_not_write(make_recipe, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = invoke("tokenize", make_recipe(), "--output", out)
    assert result.exit_code == 2 and "replaces only" in result.output
    assert (out / "notes.txt").read_text() == "keep me"



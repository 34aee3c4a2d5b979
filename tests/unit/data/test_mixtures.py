"""Mixtures (`data.datasets`): amounts per epoch, a draw that is a function of (seed, epoch), exact resume in the
middle of a mixture, packing that isolates examples of different sources, eval per source, and errors that name
the source."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from support.cli import invoke
from support.rows import alpaca_rows, write_jsonl
from support.runs import read_metrics
from gpupoor.data.mixture import Mixture, Source, source_counts
from support.mixtures import two_sources


def test_source_counts_by_weight_rows_and_epochs():
    assert source_counts([40, 40], [3.0, 1.0], [None, None], [None, None]) == [60, 20]
    assert source_counts([10, 30], [None, None], [25, None], [None, 0.5]) == [25, 15]
    assert source_counts([10, 30], [None, None], [None, None], [None, None]) == [10, 30]


def test_the_draw_is_a_function_of_seed_and_epoch_and_repeats_a_small_source():
    sources = [Source("a", 0, 10, 25), Source("b", 10, 40, 15)]
    mixture = Mixture(sources, seed=7)

    def draw(epoch):
        return mixture.draw(epoch, torch.Generator().manual_seed(epoch))

    first = draw(0)
    assert first == draw(0) and first != draw(1)
    from_a = [i for i in first if i < 10]
    assert len(from_a) == 25 and len(first) == 40
    # 25 from 10 examples: two full passes plus 5, so every example at least twice, none more than three times.
    assert {from_a.count(i) for i in range(10)} <= {2, 3} and sorted(set(from_a)) == list(range(10))
    assert len({i for i in first if i >= 10}) == 15  # 15 distinct of b's 30


def test_packing_keeps_examples_of_different_sources_apart(tiny_model, tokenizer, two_sources, tmp_path):
    """A packed micro-batch of a mixture holds examples of both sources; each example's loss equals its loss
    alone (float64, sdpa: summation order only)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gpupoor.data.build import build_data, collate_packed
    from gpupoor.data.assembly import IGNORE_INDEX
    from gpupoor.recipe.schema import DataSection

    main, extra = two_sources
    data = DataSection(datasets=[{"path": str(main), "rows": 6}, {"path": str(extra), "rows": 6}], format="alpaca",
                       max_length=128, sampler="packed")
    bundle = build_data(data, tokenizer, micro_batch_size=1, seed=0, base_dir=tmp_path, use_cache=False,
                        sampler="packed")
    batch_indices = next(b for b in bundle.plan.epoch(0)
                         if {bundle.mixture.source_of(i) for i in b} == {"main", "extra"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa", dtype=torch.float64)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))

    def loss_sum(batch):
        logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False).logits
        return F.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], ignore_index=IGNORE_INDEX, reduction="sum")

    with torch.no_grad():
        packed = collate_packed(bundle.train, batch_indices, bundle.plan.row_length)
        rows = [{k: v[r:r + 1] for k, v in packed.items()} for r in range(packed["input_ids"].shape[0])]
        together = sum(float(loss_sum(row)) for row in rows)
        alone = sum(float(loss_sum(collate_packed(bundle.train, [i]))) for i in batch_indices)
    assert together == pytest.approx(alone, rel=1e-10)


def test_the_data_identity_checkpoints_record_is_the_one_older_versions_recorded(tokenizer):
    """Resume compares the data identity recorded in checkpoints: a new cache layout (or a setting added since,
    at its default) must not change it, or every earlier run's resume would be refused. The first version
    hashed exactly these settings."""
    import hashlib
    import json

    from gpupoor.data.dataset import data_identity, tokenizer_fingerprint
    from gpupoor.data.encoder import Encoder

    for fmt, template in (("alpaca", None), ("text", None), ("chat", "chatml")):
        encoder = Encoder(tokenizer, fmt, 128, False, chat_template=template)
        first = {"version": "1", "format": fmt, "max_length": 128, "train_on_prompt": False, "text_field": "text",
                 "messages_field": "messages", "template": encoder.chat_template if fmt == "chat" else None}
        digest = hashlib.sha256(b"data-bytes")
        digest.update(tokenizer_fingerprint(tokenizer).encode())
        digest.update(json.dumps(first, sort_keys=True).encode())
        assert data_identity("data-bytes", tokenizer, encoder) == digest.hexdigest()[:32], fmt


def test_held_out_rows_are_not_counted_as_training_examples(tokenizer, two_sources, tmp_path):
    """The start-up summary's counts (each source's and the whole data's) are the training examples alone: the
    rows eval_rows holds out are eval's (#25)."""
    from gpupoor.data.build import build_data
    from gpupoor.recipe.schema import DataSection

    main, extra = two_sources
    data = DataSection(datasets=[{"path": str(main), "eval_rows": 6}, {"path": str(extra), "eval_rows": 4}],
                       format="alpaca", max_length=128, sampler="random")
    bundle = build_data(data, tokenizer, micro_batch_size=1, seed=0, base_dir=tmp_path, use_cache=False)
    whole = build_data(DataSection(datasets=[{"path": str(main)}, {"path": str(extra)}], format="alpaca",
                                   max_length=128, sampler="random"), tokenizer, micro_batch_size=1, seed=0, base_dir=tmp_path,
                       use_cache=False)

    def counted(dataset):  # tokens and targets counted example by example (the first token is never a target)
        examples = [dataset[i] for i in range(len(dataset))]
        return sum(len(ids) for ids, _ in examples), sum(int((labels[1:] != -100).sum()) for _, labels in examples)

    for source, stats, eval_rows in zip(bundle.mixture.sources, bundle.source_stats, (6, 4)):
        assert (stats.rows, stats.kept) == (40 - eval_rows, source.size) == (40 - eval_rows, 40 - eval_rows)
        assert source.eval_end - source.eval_start == eval_rows
    stats = bundle.train.stats
    assert (stats.rows, stats.kept) == (70, len(bundle.train)) == (70, 70)
    assert (stats.tokens, stats.target_tokens) == counted(bundle.train)
    assert (bundle.eval.stats.tokens, bundle.eval.stats.target_tokens) == counted(bundle.eval)
    assert stats.tokens + bundle.eval.stats.tokens == whole.train.stats.tokens

"""Packing: whole examples in one row, attention isolated, numbers equal to running them one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpupoor.data.build import collate_packed
from gpupoor.data.dataset import TokenizedDataset, TokenStats
from gpupoor.data.assembly import IGNORE_INDEX
from gpupoor.data.sampler import BatchPlan
from support.packing import TEXTS, _dataset


def test_packed_plan_holds_every_example_once_within_the_budget():
    lengths = [(i * 37) % 120 + 5 for i in range(700)]
    plan = BatchPlan(lengths, micro_batch_size=4, seed=3, kind="packed", max_length=128)
    epoch0 = plan.epoch(0)
    assert sorted(i for b in epoch0 for i in b) == list(range(700))
    assert all(sum(lengths[i] for i in b) <= 4 * 128 for b in epoch0)
    fill = sum(lengths) / (len(epoch0) * 4 * 128)
    assert fill > 0.95  # first-fit-decreasing leaves little room unused
    assert epoch0 == BatchPlan(lengths, 4, 3, "packed", 128).epoch(0) and epoch0 != plan.epoch(1)


def test_packed_rows_restart_positions_and_mask_example_starts(tokenizer):
    dataset = _dataset(tokenizer, TEXTS)
    lengths = [dataset.lengths[i] for i in (2, 0, 3)]
    batch = collate_packed(dataset, [2, 0, 3])  # no row limit: one row
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, sum(lengths))
    starts = (batch["position_ids"][0] == 0).nonzero().flatten()
    assert len(starts) == 3 and (batch["labels"][0, starts] == IGNORE_INDEX).all()
    rows = collate_packed(dataset, [0, 1, 2, 3], row_length=max(dataset.lengths) + 2, pad_id=0)
    assert rows["input_ids"].shape[0] >= 2 and rows["input_ids"].shape[1] <= max(dataset.lengths) + 2
    assert int(rows["token_mask"].sum()) == sum(dataset.lengths)  # fillers are not counted as tokens
    assert (rows["labels"][~rows["token_mask"]] == IGNORE_INDEX).all()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_losses_and_gradients_equal_one_by_one(tiny_model, tokenizer, attention):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # float64, so the comparison does not hinge on float32 rounding (which differs between CPUs and BLAS
    # builds): with SDPA, packed and one-by-one differ only by summation order (~1e-16 relative). Eager
    # attention computes its softmax in float32 even for a float64 model, so there the differences are a
    # few float32 epsilons (measured: 3e-7 of a gradient's norm); leaking attention across examples is >1e-3.
    tolerance = 1e-10 if attention == "sdpa" else 1e-5
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attention, dtype=torch.float64)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).train()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    dataset = _dataset(tokenizer, TEXTS)
    order = [1, 3, 0, 2]

    def per_token(logits, labels):
        return F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="none")

    # Two rows, each with a filler block: examples packed beside each other and beside padding.
    packed = collate_packed(dataset, order, row_length=max(dataset.lengths) + 8)
    assert packed["input_ids"].shape[0] == 2
    model.zero_grad()
    logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
    losses = torch.stack([per_token(logits[r:r + 1], packed["labels"][r:r + 1]) for r in range(2)])
    losses.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    # Per-example sums: an example spans a run of positions starting at position_id 0; position t predicts
    # t+1, so it owns the losses at [start, end - 1). Examples are recognised by their tokens.
    packed_by_example = {}
    for r in range(2):
        positions = packed["position_ids"][r].tolist() + [0]
        starts = [t for t, p in enumerate(positions) if p == 0]
        for a, b in zip(starts, starts[1:]):
            tokens = tuple(packed["input_ids"][r, a:b].tolist())
            packed_by_example[tokens] = losses[r, a:b - 1].sum()
    packed_sums = [packed_by_example[tuple(dataset[i][0].tolist())] for i in order]

    model.zero_grad()
    single_sums = []
    for index in order:
        one = collate_packed(dataset, [index])
        single = per_token(model(input_ids=one["input_ids"], use_cache=False).logits, one["labels"]).sum()
        single.backward()
        single_sums.append(single)
    for packed_sum, single_sum in zip(packed_sums, single_sums):
        assert abs(float(packed_sum.detach() - single_sum.detach())) <= tolerance * abs(float(single_sum.detach()))
    for name, grad in packed_grads.items():
        single_grad = dict(model.named_parameters())[name].grad
        assert (grad - single_grad).norm() <= tolerance * single_grad.norm(), name

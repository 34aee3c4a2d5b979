"""The distillation loss: the fused chunked KL + cross-entropy against the plain formula (values and gradients,
in float64 so the comparison does not hinge on float32 rounding), chunking, heads of different sizes, the
memory it never allocates, and the tokenizer check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpupoor.decisions as decisions
from support.batches import masked_batch
from gpupoor.objectives.distill import (check_vocabularies, distill_loss_sum, linear_distill_sum, plain_distill_loss_sum)
from gpupoor.errors import UserError
from gpupoor.objectives.cross_entropy import find_fused_head, fused_loss_sum, linear_cross_entropy_sum, plain_loss_sum
from support.distill_loss import _largest_allocation_and_peak

WEIGHTS = [0.0, 0.5, 1.0]
TEMPERATURES = [1.0, 2.0]


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-9) -> bool:
    """Equal up to `rel` of b's norm (an absolute floor for a zero b)."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm()) <= rel * max(float(b.norm()), 1e-30)


def reference(student_logits, teacher_logits, targets, temperature, weight):
    """The formula, written out from the definition with full logits."""
    common = min(student_logits.shape[-1], teacher_logits.shape[-1])
    log_p = F.log_softmax(teacher_logits[:, :common] / temperature, dim=-1)
    log_q = F.log_softmax(student_logits[:, :common] / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum()
    ce = F.cross_entropy(student_logits, targets, reduction="sum")
    return weight * temperature ** 2 * kl + (1 - weight) * ce


def _tensors(student_vocab=50, teacher_vocab=50, tokens=45, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(tokens, 16, dtype=torch.float64, generator=generator) * 2).requires_grad_()
    weight = torch.randn(student_vocab, 16, dtype=torch.float64, generator=generator)
    teacher_hidden = torch.randn(tokens, 24, dtype=torch.float64, generator=generator) * 2
    teacher_weight = torch.randn(teacher_vocab, 24, dtype=torch.float64, generator=generator)
    targets = torch.randint(0, min(student_vocab, teacher_vocab), (tokens,), generator=generator)
    return hidden, weight, teacher_hidden, teacher_weight, targets


def _fused_and_reference(hidden, weight, teacher_hidden, teacher_weight, targets, temperature, kd_weight,
                         chunk=None):
    hidden.grad = weight.grad = None
    ours = linear_distill_sum(hidden, weight, teacher_hidden, teacher_weight, targets, temperature, kd_weight,
                              chunk=chunk)
    (ours * 0.5).backward()  # an upstream scale, as the loop applies 1 / target tokens
    fused = (ours.detach(), hidden.grad.clone(), weight.grad.clone() if weight.requires_grad else None)
    hidden.grad = weight.grad = None
    plain = reference(hidden @ weight.t(), teacher_hidden @ teacher_weight.t(), targets, temperature, kd_weight)
    (plain * 0.5).backward()
    return fused, (plain.detach(), hidden.grad, weight.grad)


@pytest.mark.parametrize("kd_weight", WEIGHTS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("vocabularies", [(50, 50), (50, 57), (57, 50)], ids=["same", "teacher_padded",
                                                                               "student_padded"])
def test_linear_distill_matches_the_formula(kd_weight, temperature, vocabularies):
    hidden, weight, teacher_hidden, teacher_weight, targets = _tensors(*vocabularies)
    weight.requires_grad_()
    # 7 tokens per chunk: many chunks and a ragged last one.
    fused, plain = _fused_and_reference(hidden, weight, teacher_hidden, teacher_weight, targets, temperature,
                                        kd_weight, chunk=7)
    assert close(fused[0], plain[0], 1e-12)
    assert close(fused[1], plain[1])
    assert close(fused[2], plain[2])


def test_the_padded_ids_do_not_enter_the_kl():
    """The KL covers the ids both heads have: what a padded teacher head says beyond them changes nothing."""
    hidden, weight, teacher_hidden, teacher_weight, targets = _tensors(50, 57)
    before = linear_distill_sum(hidden, weight, teacher_hidden, teacher_weight, targets, 2.0, 0.5, chunk=7)
    teacher_weight[50:] = 100.0
    after = linear_distill_sum(hidden, weight, teacher_hidden, teacher_weight, targets, 2.0, 0.5, chunk=7)
    assert torch.equal(before, after)
    restricted = linear_distill_sum(hidden, weight, teacher_hidden, teacher_weight[:50], targets, 2.0, 0.5, chunk=7)
    assert close(after, restricted, 1e-14)


def test_weight_zero_is_the_fused_cross_entropy():
    hidden, weight, teacher_hidden, teacher_weight, targets = _tensors()
    ours = linear_distill_sum(hidden, weight, teacher_hidden, teacher_weight, targets, 2.0, 0.0, chunk=7)
    assert close(ours, linear_cross_entropy_sum(hidden, weight, targets), 1e-14)


def test_chunking_does_not_change_the_result(monkeypatch):
    hidden, weight, teacher_hidden, teacher_weight, targets = _tensors()
    weight.requires_grad_()
    whole, _ = _fused_and_reference(hidden, weight, teacher_hidden, teacher_weight, targets, 2.0, 0.5,
                                    chunk=len(targets))
    monkeypatch.setattr(decisions, "CHUNK_ELEMENTS", 4 * 50)  # the default chunk: 4 tokens
    monkeypatch.setattr(decisions, "MIN_CHUNK_TOKENS", 1)
    assert decisions.loss_chunk_tokens(50) == 4
    chunked, _ = _fused_and_reference(hidden, weight, teacher_hidden, teacher_weight, targets, 2.0, 0.5)
    for a, b in zip(chunked, whole):
        assert close(a, b, 1e-13)


def test_no_grad_gives_the_same_loss_and_empty_batches_stay_connected():
    hidden, weight, teacher_hidden, teacher_weight, targets = _tensors()
    with torch.no_grad():
        value = linear_distill_sum(hidden, weight, teacher_hidden, teacher_weight, targets, 2.0, 0.5, chunk=7)
    assert close(value, reference(hidden @ weight.t(), teacher_hidden @ teacher_weight.t(), targets, 2.0, 0.5),
                 1e-12)
    weight.requires_grad_()
    empty = linear_distill_sum(hidden[:0], weight, teacher_hidden[:0], teacher_weight, targets[:0], 2.0, 0.5)
    empty.backward()
    assert float(empty.detach()) == 0.0 and torch.count_nonzero(weight.grad) == 0 and hidden.grad is not None


def test_a_bf16_teacher_gets_fp32_logits():
    """A bf16 teacher head (a 4-bit model's compute dtype) on a device with no bf16 x bf16 -> fp32 product:
    its logits come from fp32 slices of the head, equal to the fp32 product of the bf16 values."""
    hidden, weight, teacher_hidden, teacher_weight, targets = _tensors()
    student = hidden.detach().float().requires_grad_()
    teacher_hidden, teacher_weight = teacher_hidden.bfloat16(), teacher_weight.bfloat16()
    ours = linear_distill_sum(student, weight.float(), teacher_hidden, teacher_weight, targets, 2.0, 0.5, chunk=7)
    ours.backward()
    exact = hidden.detach().requires_grad_()  # float64, with the teacher's bf16 values made exact
    plain = reference(exact @ weight.t(), teacher_hidden.double() @ teacher_weight.double().t(), targets, 2.0, 0.5)
    plain.backward()
    assert ours.dtype == torch.float32
    assert close(ours.double(), plain.detach(), 1e-6)
    assert close(student.grad.double(), exact.grad, 1e-5)


# ---------------------------------------------------------------------------------------------- on models


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tokenizer):
    """A teacher of another width, with its head padded beyond the tokenizer like Qwen's 152,064 rows."""
    from gpupoor.model.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "teacher", tokenizer, hidden=48, layers=2, heads=4,
                            kv_heads=2, seed=3, vocab_size=len(tokenizer) + 24)


@pytest.fixture(scope="module")
def same_size_teacher_dir(tmp_path_factory, tokenizer):
    from gpupoor.model.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "teacher_same", tokenizer, hidden=48, layers=2,
                            heads=4, kv_heads=2, seed=4)


def _student(model_dir, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    # init_lora_weights=False: B is not zero, so the LoRA A gradients are real.
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, **lora))
    return model.train().double()


def _teacher(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).double().eval()
    model.requires_grad_(False)
    return model


def _loss_and_grads(student, teacher, batch, temperature, kd_weight, fused):
    student.zero_grad(set_to_none=True)
    if fused:
        student_head, why = find_fused_head(student)
        teacher_head, teacher_why = find_fused_head(teacher)
        assert student_head is not None and teacher_head is not None, (why, teacher_why)
        loss = distill_loss_sum(student, teacher, batch, student_head, teacher_head, temperature, kd_weight)
    else:
        loss = plain_distill_loss_sum(student, teacher, batch, temperature, kd_weight)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    return loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kd_weight", WEIGHTS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("case", ["lora", "trained_head"])
def test_fused_distillation_equals_the_plain_loss_on_models(case, temperature, kd_weight, tiny_model, teacher_dir,
                                                           tokenizer):
    extra = {"modules_to_save": ["lm_head"]} if case == "trained_head" else {}
    student, teacher, batch = _student(tiny_model, **extra), _teacher(teacher_dir), masked_batch(tokenizer)
    plain_loss, plain_grads = _loss_and_grads(student, teacher, batch, temperature, kd_weight, fused=False)
    fused_loss, fused_grads = _loss_and_grads(student, teacher, batch, temperature, kd_weight, fused=True)
    assert close(fused_loss, plain_loss, 1e-12)
    assert fused_grads.keys() == plain_grads.keys()
    assert any("lora_A" in name for name in fused_grads)
    if case == "trained_head":
        assert any("lm_head" in name for name in fused_grads)
    for name, grad in plain_grads.items():
        assert fused_grads[name].dtype == torch.float64, name
        assert close(fused_grads[name], grad), name


def test_weight_zero_on_models_is_the_cross_entropy(tiny_model, teacher_dir, tokenizer):
    student, teacher, batch = _student(tiny_model), _teacher(teacher_dir), masked_batch(tokenizer)
    head, _ = find_fused_head(student)
    ours, ours_grads = _loss_and_grads(student, teacher, batch, 1.0, 0.0, fused=True)
    student.zero_grad(set_to_none=True)
    fused_ce = fused_loss_sum(student, batch, head)
    fused_ce.backward()
    for name, param in student.named_parameters():
        if param.requires_grad:
            assert close(ours_grads[name], param.grad, 1e-12), name
    assert close(ours, fused_ce.detach(), 1e-13)
    # plain_loss_sum casts the logits to float32: equal to a few float32 epsilons.
    assert close(ours, plain_loss_sum(student, batch).detach().double(), 1e-6)


def test_padded_teacher_head_is_restricted_to_the_common_ids(tiny_model, teacher_dir, tokenizer):
    """The padded teacher equals the same teacher with its head cut to the tokenizer's ids."""
    student, teacher, batch = _student(tiny_model), _teacher(teacher_dir), masked_batch(tokenizer)
    assert teacher.lm_head.weight.shape[0] > student.get_output_embeddings().weight.shape[0]
    padded, padded_grads = _loss_and_grads(student, teacher, batch, 2.0, 0.5, fused=True)
    with torch.no_grad():
        teacher.lm_head.weight[len(tokenizer):] = 50.0  # whatever the padding says is ignored
    loud, _ = _loss_and_grads(student, teacher, batch, 2.0, 0.5, fused=True)
    cut = torch.nn.Linear(48, len(tokenizer), bias=False, dtype=torch.float64)
    cut.weight.data = teacher.lm_head.weight.data[:len(tokenizer)].clone()
    teacher.lm_head = cut
    teacher.config.vocab_size = len(tokenizer)
    restricted, restricted_grads = _loss_and_grads(student, teacher, batch, 2.0, 0.5, fused=False)
    assert torch.equal(padded, loud)
    assert close(padded, restricted, 1e-12)
    for name, grad in restricted_grads.items():
        assert close(padded_grads[name], grad), name


def test_chunked_on_models_equals_one_chunk(monkeypatch, tiny_model, same_size_teacher_dir, tokenizer):
    student, teacher, batch = _student(tiny_model), _teacher(same_size_teacher_dir), masked_batch(tokenizer)
    whole, whole_grads = _loss_and_grads(student, teacher, batch, 2.0, 0.5, fused=True)
    monkeypatch.setattr(decisions, "CHUNK_ELEMENTS", 3 * len(tokenizer))  # 3 target tokens per chunk
    monkeypatch.setattr(decisions, "MIN_CHUNK_TOKENS", 1)
    chunked, chunked_grads = _loss_and_grads(student, teacher, batch, 2.0, 0.5, fused=True)
    assert close(chunked, whole, 1e-13)
    for name, grad in whole_grads.items():
        assert close(chunked_grads[name], grad, 1e-12), name


# ------------------------------------------------------------------------------------------------- memory


def test_the_fused_loss_never_allocates_the_full_logits(monkeypatch):
    vocab, tokens, width = 16384, 512, 16
    monkeypatch.setattr(decisions, "CHUNK_ELEMENTS", 32 * vocab)  # 32 tokens per chunk
    monkeypatch.setattr(decisions, "MIN_CHUNK_TOKENS", 1)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, requires_grad=True)
    teacher_hidden = torch.randn(tokens, 2 * width, generator=generator)
    teacher_weight = torch.randn(vocab + 128, 2 * width, generator=generator)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    full_logits = tokens * vocab * 4  # one float32 tokens x vocab tensor: 32 MiB

    def fused():
        linear_distill_sum(hidden, weight, teacher_hidden, teacher_weight, targets, 2.0, 0.5).backward()

    def plain():
        reference(hidden @ weight.t(), teacher_hidden @ teacher_weight.t(), targets, 2.0, 0.5).backward()

    largest, peak = _largest_allocation_and_peak(fused)
    plain_largest, plain_peak = _largest_allocation_and_peak(plain)
    print(f"largest {largest:,} peak {peak:,}; plain: largest {plain_largest:,} peak {plain_peak:,}")
    assert plain_largest >= full_logits  # the measurement sees what the plain formula allocates
    assert largest < full_logits / 8 and peak < full_logits / 2, (largest, peak, full_logits)
    assert peak < plain_peak / 8, (peak, plain_peak)


def test_the_fused_loss_on_models_never_allocates_the_full_logits(monkeypatch, tmp_path, tokenizer):
    """Through the models' own forwards too: the heads are asked for one position's logits only."""
    from gpupoor.model.tiny import build_tiny_llama

    vocab = 16384
    monkeypatch.setattr(decisions, "CHUNK_ELEMENTS", 8 * vocab)  # 8 tokens per chunk
    monkeypatch.setattr(decisions, "MIN_CHUNK_TOKENS", 1)
    student_dir = build_tiny_llama(tmp_path / "s", tokenizer, hidden=16, layers=1, heads=2, kv_heads=1,
                                   vocab_size=vocab)
    teacher_dir = build_tiny_llama(tmp_path / "t", tokenizer, hidden=16, layers=1, heads=2, kv_heads=1, seed=1,
                                   vocab_size=vocab + 64)
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(student_dir)
    student.requires_grad_(False)
    student.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)  # a gradient that needs the head's
    teacher = _teacher(teacher_dir).float()
    ids = torch.randint(5, len(tokenizer), (4, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    targets = 4 * 63
    full_logits = targets * vocab * 4
    student_head, teacher_head = find_fused_head(student)[0], find_fused_head(teacher)[0]

    def fused():
        distill_loss_sum(student, teacher, batch, student_head, teacher_head, 2.0, 0.5).backward()

    largest, peak = _largest_allocation_and_peak(fused)
    plain_largest, plain_peak = _largest_allocation_and_peak(
        lambda: plain_distill_loss_sum(student, teacher, batch, 2.0, 0.5).backward())
    print(f"largest {largest:,} peak {peak:,}; plain: largest {plain_largest:,} peak {plain_peak:,}")
    assert plain_largest >= full_logits
    assert largest < full_logits / 8 and peak < full_logits / 2, (largest, peak, full_logits)


# --------------------------------------------------------------------------------------------- tokenizers


def test_check_vocabularies(tokenizer, tiny_model):
    from transformers import AutoTokenizer

    from gpupoor.model.tiny import train_tokenizer

    check_vocabularies(tokenizer, AutoTokenizer.from_pretrained(tiny_model))  # the same tokenizer, saved and loaded
    other = train_tokenizer(["a different corpus gives different merges and ids " * 3] * 50, vocab_size=300)
    with pytest.raises(UserError) as raised:
        check_vocabularies(tokenizer, other)
    message = str(raised.value)
    assert "distill.teacher" in message and "student's tokenizer" in message
    assert f"{len(tokenizer.get_vocab()):,}" in message and f"{len(other.get_vocab()):,}" in message

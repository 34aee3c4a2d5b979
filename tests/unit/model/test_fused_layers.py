"""model.fused_layers: the fused LoRA linears, gated MLP and per-example attention give the plain transformers +
peft model's loss and gradients (float64, so any x86 BLAS agrees to ~1e-12), hand over to the plain modules
wherever their arithmetic is not plain LoRA on a frozen dense base, and keep fewer activations."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.memory import saved_tensor_bytes
from gpupoor.decisions import FUSED_FAMILIES
from gpupoor.model.fast_paths import apply_fast_paths
from gpupoor.model.fused_lora import fuse_lora_layers
from gpupoor.model import packed_attention
from gpupoor.model.packed_attention import PerExampleAttention, example_groups, segment_lengths, use_packed_attention
from support.fused_layers import VOCAB, tiny_family, with_lora


def packed_batch(rows=2, length=24):
    """Two packed rows: examples of 10, 9 and 5 tokens, and of 20 and a 4-token filler."""
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, length))
    positions = torch.stack([torch.cat([torch.arange(10), torch.arange(9), torch.arange(5)]),
                             torch.cat([torch.arange(20), torch.arange(4)])])
    labels = ids.clone()
    labels[:, 0] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def assert_same(plain, fused, rel=1e-10):
    (plain_loss, plain_grads), (fused_loss, fused_grads) = plain, fused
    assert torch.allclose(fused_loss, plain_loss, rtol=rel, atol=0), (fused_loss, plain_loss)
    assert plain_grads.keys() == fused_grads.keys()
    for name, grad in plain_grads.items():
        error = (fused_grads[name] - grad).norm() / grad.norm()
        assert error < rel, (name, error.item())


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_fused_layers_give_the_plain_models_loss_and_gradients_on_packed_rows(family):
    plain = with_lora(tiny_family(family))
    fused = copy.deepcopy(plain)
    choice = apply_fast_paths(fused, True)
    assert choice.value == "on" and "gated MLP x2" in choice.reason and "sdpa per packed example" in choice.reason
    batch = packed_batch()
    assert_same(loss_and_grads(plain, batch), loss_and_grads(fused, batch))


def test_attention_crosses_no_example_in_a_packed_row():
    """Changing the tokens of the second example leaves the first example's logits untouched, and the fused
    attention agrees with transformers' block-diagonal mask for the whole row."""
    model = with_lora(tiny_family("llama"))
    apply_fast_paths(model, True)
    batch = packed_batch()
    changed = {**batch, "input_ids": batch["input_ids"].clone()}
    changed["input_ids"][0, 10:19] = (changed["input_ids"][0, 10:19] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(**batch).logits, model(**changed).logits
    assert torch.equal(before[0, :10], after[0, :10])
    assert not torch.allclose(before[0, 10:19], after[0, 10:19])


def test_padded_batches_and_generation_run_transformers_own_attention():
    """A batch with an attention mask (padding) and a cached generation give what the plain model gives."""
    plain = with_lora(tiny_family("qwen2"))
    fused = copy.deepcopy(plain)
    apply_fast_paths(fused, True)
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        assert torch.allclose(fused(input_ids=ids, attention_mask=mask).logits,
                              plain(input_ids=ids, attention_mask=mask).logits, rtol=1e-10, atol=1e-12)
    for model in (plain, fused):
        model.config.use_cache = True
        model.get_base_model().config.use_cache = True
    prompt = ids[:1, :6]
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(fused.generate(input_ids=prompt, **kwargs), plain.generate(input_ids=prompt, **kwargs))


def test_masked_attention_shares_the_key_and_value_heads_instead_of_keeping_repeated_copies(monkeypatch):
    """GRPO's update: answers read after their left-padded prompts' cache (a mask, several queries a row). The
    fused model gives the plain model's log-probabilities and gradients, and keeps for backward the keys and values
    at their own 2 heads: the plain SDPA function repeats them to the 4 query heads (repeat_kv) and keeps the copies."""
    from gpupoor.objectives.grpo.rollout import Sampled, shared_prompt_logprobs

    plain = with_lora(tiny_family("llama"))
    fused = copy.deepcopy(plain)
    apply_fast_paths(fused, True)
    torch.manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,)).tolist() for n in (9, 6)]  # the second left-padded by 3
    answers = torch.randint(1, VOCAB, (4, 5)).tolist()
    sampled = Sampled([p for p in prompts for _ in range(2)], answers)

    def logprobs(model):
        return shared_prompt_logprobs(model, sampled, 2, 5, pad_id=0)[0].sum()

    results = []
    for model in (plain, fused):
        model.zero_grad()
        logp = logprobs(model)
        logp.backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    assert_same(*results)
    shared = saved_tensor_bytes(fused, lambda: logprobs(fused))
    monkeypatch.setattr(packed_attention, "_plain_sdpa", lambda kwargs: False)  # transformers' SDPA function
    repeating = saved_tensor_bytes(fused, lambda: logprobs(fused))
    config = plain.get_base_model().config
    # per layer: the 4 answers' keys and values over 8 cached + 5 new positions, at 2 more heads (8 wide, float64)
    repeated = config.num_hidden_layers * 2 * 4 * (config.num_attention_heads - config.num_key_value_heads) \
        * (8 + 5) * config.head_dim * 8
    assert repeating - shared >= repeated, (repeating, shared, repeated)


@pytest.mark.parametrize("variant", ["dropout", "dora", "qv_only", "adapter_disabled", "full"])
def test_each_fused_module_hands_over_where_its_arithmetic_differs(variant):
    """LoRA dropout, DoRA and a disabled adapter (DPO's reference pass) run peft's own forward; LoRA on q and v
    only leaves the MLP's linears frozen and plain (fused still); `full` trains the base weights (plain)."""
    base = tiny_family("llama")
    if variant == "full":
        plain = base
    else:
        options = {"dropout": {"lora_dropout": 0.1}, "dora": {"use_dora": True},
                   "qv_only": {"target_modules": ["q_proj", "v_proj"]}}.get(variant, {})
        plain = with_lora(base, **options)
    fused = copy.deepcopy(plain)
    # Installed regardless of what the recipe rule (choose_fused_paths) would install: each module must hand over.
    fuse_lora_layers(fused)
    use_packed_attention(fused)
    batch = packed_batch()
    if variant == "adapter_disabled":
        with torch.no_grad(), plain.disable_adapter(), fused.disable_adapter():
            assert torch.allclose(fused(**batch).logits, plain(**batch).logits, rtol=1e-10, atol=1e-12)
        return
    if variant == "dropout":  # the same dropout masks on both sides
        torch.manual_seed(3)
        plain_result = loss_and_grads(plain, batch)
        torch.manual_seed(3)
        assert_same(plain_result, loss_and_grads(fused, batch))
        return
    assert_same(loss_and_grads(plain, batch), loss_and_grads(fused, batch))


def test_gradient_checkpointing_over_fused_layers_gives_the_same_gradients():
    plain = tiny_family("llama")
    plain.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    plain = with_lora(plain)
    fused = copy.deepcopy(plain)
    apply_fast_paths(fused, True)
    batch = packed_batch()
    assert_same(loss_and_grads(plain, batch), loss_and_grads(fused, batch))


def test_fused_layers_keep_two_intermediate_wide_tensors_per_token_fewer():
    """Saved-tensor hooks over one forward: the fused model keeps at least 2 x intermediate x tokens x 8 bytes
    fewer per layer (gate's activation and the MLP product are recomputed) than the plain one."""
    plain = with_lora(tiny_family("llama"))
    fused = copy.deepcopy(plain)
    apply_fast_paths(fused, True)
    batch = packed_batch()
    tokens, layers, intermediate = batch["input_ids"].numel(), 2, 64
    saved = {name: saved_tensor_bytes(model, lambda m=model: m(**batch)) for name, model in
             (("plain", plain), ("fused", fused))}
    assert saved["plain"] - saved["fused"] >= 2 * intermediate * tokens * 8 * layers


def test_other_families_settings_that_change_the_arithmetic_and_the_switch_keep_the_plain_modules():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = with_lora(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB)),
                     target_modules=["c_attn"], fan_in_fan_out=True)
    choice = apply_fast_paths(gpt2, True)
    assert choice.value == "off" and "gpt2 is not one of llama, qwen2, mistral, gemma" in choice.reason
    assert "forward" not in vars(gpt2.get_base_model().transformer.h[0].mlp)
    for settings, why in (({"dropout": 0.1}, "peft.dropout > 0"), ({"precision": "fp16"}, "fp16 weights"),
                          ({"bits": 4}, "a quantized base"), ({"method": "dora"}, "peft.method dora")):
        choice = apply_fast_paths(with_lora(tiny_family("llama")), True, **settings)
        assert why in choice.reason and "LoRA linears x" not in choice.reason, choice.reason
    llama = with_lora(tiny_family("llama"))
    assert apply_fast_paths(llama, False).value == "off"
    assert not any("forward" in vars(module) for module in llama.modules())
    assert llama.get_base_model().config._attn_implementation == "sdpa"


def test_segment_lengths_follow_position_restarts_row_by_row():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert segment_lengths(positions) == [3, 2, 1, 6]


def test_examples_of_similar_length_share_one_padded_batch_and_map_back_to_their_rows():
    lengths = (10, 9, 5, 20, 4)
    groups = example_groups(lengths, "cpu", ratio=0.75)
    assert groups.shapes == [(1, 20), (2, 10), (2, 5)]  # 9 >= 0.75 * 10 joins 10; 5 < 7.5 starts a group
    rows = torch.arange(sum(lengths))
    padded = rows[groups.gather]
    assert padded.numel() == 20 + 2 * 10 + 2 * 5
    assert torch.equal(padded[groups.inverse], rows)
    assert groups.pads.tolist() == [20 + 19, 20 + 2 * 10 + 9]  # the 9- and 4-token examples' last slot


def reference_attention(q_rows, k_rows, v_rows, lengths):
    """Causal SDPA over each example on its own (rows (tokens, heads, dim))."""
    out, start = [], 0
    for length in lengths:
        q, k, v = (t[start:start + length].transpose(0, 1)[None] for t in (q_rows, k_rows, v_rows))
        out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=True)[0].transpose(0, 1))
        start += length
    return torch.cat(out)


@pytest.mark.parametrize("ratio", [0.0, 0.75, 1.0])
@pytest.mark.parametrize("kernel", ["cpu flash ops", "recompute"])
def test_grouped_attention_equals_each_example_on_its_own(monkeypatch, ratio, kernel):
    """Whether every example is padded to the longest (ratio 0), grouped, or alone (1.0), through the CPU flash
    ops or the recomputing path (a GPU's), output and gradients are each example's own causal attention."""
    monkeypatch.setattr(packed_attention, "GROUP_RATIO", ratio)
    if kernel == "recompute":
        monkeypatch.setattr(packed_attention, "_CPU_FLASH", None)
    else:
        assert packed_attention._CPU_FLASH is not None  # this torch has the ops; otherwise the test is moot
    lengths = (7, 13, 3, 12, 1, 6)
    torch.manual_seed(2)
    leaves = [torch.randn(sum(lengths), heads, 8, dtype=torch.float64, requires_grad=True) for heads in (4, 2, 2)]
    grad_out = torch.randn(sum(lengths), 4, 8, dtype=torch.float64)
    out = PerExampleAttention.apply(*leaves, lengths, None)
    grads = torch.autograd.grad(out, leaves, grad_out)
    expected = reference_attention(*leaves, lengths)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    assert (out - expected).norm() <= 1e-12 * expected.norm()
    for grad, expected_grad in zip(grads, expected_grads):
        assert (grad - expected_grad).norm() <= 1e-12 * expected_grad.norm()


def test_bf16_attention_runs_the_cpu_kernel_in_fp32_and_keeps_bf16_activations():
    """bf16 q, k, v go through the CPU flash kernel in fp32 (its bf16 path is the slower one): the output and the
    gradients are the fp32 attention of the same bf16 values, rounded once to bf16 (to 2^-8 of the norm), and
    what backward keeps is bf16, as before."""
    assert packed_attention._CPU_FLASH is not None
    lengths = (7, 13, 3, 12, 1, 6)
    torch.manual_seed(3)
    leaves = [torch.randn(sum(lengths), heads, 8, dtype=torch.bfloat16, requires_grad=True) for heads in (4, 2, 2)]
    grad_out = torch.randn(sum(lengths), 4, 8, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        out = PerExampleAttention.apply(*leaves, lengths, None)
    grads = torch.autograd.grad(out, leaves, grad_out)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    assert set(saved) <= {torch.bfloat16, torch.float32} and saved.count(torch.bfloat16) == 4  # q, k, v, output
    exact = [t.detach().double().requires_grad_() for t in leaves]
    expected = reference_attention(*exact, lengths)
    expected_grads = torch.autograd.grad(expected, exact, grad_out.double())
    assert (out.double() - expected).norm() <= 2**-8 * expected.norm()
    for grad, expected_grad in zip(grads, expected_grads):
        assert (grad.double() - expected_grad).norm() <= 2**-8 * expected_grad.norm()


@pytest.mark.parametrize("family, extra", [("mistral", {"sliding_window": 6}), ("llama", {"attention_dropout": 0.3})])
def test_a_window_shorter_than_an_example_and_attention_dropout_get_the_explicit_packed_mask(family, extra):
    """Mistral's sliding window (here 6 tokens, shorter than the 10- and 20-token examples) and attention dropout
    run through transformers' SDPA with the block-diagonal mask built here: the plain model's result, the same
    dropout draws included."""
    plain = with_lora(tiny_family(family, **extra))
    fused = copy.deepcopy(plain)
    apply_fast_paths(fused, True)
    batch = packed_batch()
    torch.manual_seed(5)
    plain_result = loss_and_grads(plain, batch)
    torch.manual_seed(5)
    assert_same(plain_result, loss_and_grads(fused, batch))


def bf16_copy(model):
    """`model` as gpupoor trains it in bf16 on a CPU: the frozen base in bf16, the trainable tensors in fp32."""
    copied = copy.deepcopy(model)
    for param in copied.parameters():
        param.data = param.data.to(torch.float32 if param.requires_grad else torch.bfloat16)
    return copied


def bf16_loss_and_grads(model, batch, counter=None):
    """One step as the loop runs it in bf16 on a CPU (the forward under autocast), the gradients in float64."""
    model.zero_grad()
    with counter or contextlib.nullcontext(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
    with counter or contextlib.nullcontext():
        loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # fp32 masters
    return loss.detach().double(), {name: p.grad.double() for name, p in model.named_parameters() if p.requires_grad}


class DtypeCasts(TorchDispatchMode):
    """The casts from one floating dtype to another an autograd step runs (aten._to_copy), and their bytes."""

    def __init__(self):
        super().__init__()
        self.count = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and (kwargs or {}).get("dtype", args[0].dtype) != args[0].dtype:
            self.count += 1
            self.bytes += out.numel() * out.element_size()
        return out


def gradient_error(grads, reference) -> float:
    """The gradients' error relative to the reference's norm, over every trainable tensor together."""
    flat = torch.cat([grads[name].flatten() for name in reference])
    expected = torch.cat([grad.flatten() for grad in reference.values()])
    return ((flat - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_fused_layers_in_bf16_keep_the_loss_within_bf16s_rounding_and_cast_less_than_peft(family, monkeypatch):
    """The fused paths compute natively in bf16 (a bf16 base, fp32 LoRA masters) on packed rows. Against the same
    model in float64 (its base weights rounded to bf16, so only the arithmetic differs): the loss within one bf16
    rounding unit (2^-8 relative; measured 1e-6 to 1e-4 on AMD EPYC), the gradients no further off than peft's own
    bf16 path under autocast is (the error bf16 itself makes, 1.5-22% of the norm on these random tiny models:
    measured, fused 1.4-19%), with 25% to spare for another CPU's rounding order. And the dtype casts: peft casts
    every adapted linear's input to fp32 and autocast casts it back; the fused layers cast only the rank-wide
    factors, under half of peft's bytes (measured a third). (The per-example attention's own casts to run its
    kernel in fp32, a speed choice of its own, tested below, are left out here: the plain model has no such
    attention.)"""
    monkeypatch.setattr(packed_attention, "BF16_IN_FP32", False)
    reference = with_lora(tiny_family(family))
    for param in reference.parameters():
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16).double()
    batch = packed_batch()
    expected_loss, expected_grads = loss_and_grads(reference, batch)
    plain, fused = bf16_copy(reference), bf16_copy(reference)
    choice = apply_fast_paths(fused, True, precision="bf16")
    assert choice.value == "on" and "gated MLP x2" in choice.reason
    plain_casts, fused_casts = DtypeCasts(), DtypeCasts()
    plain_loss, plain_grads = bf16_loss_and_grads(plain, batch, plain_casts)
    fused_loss, fused_grads = bf16_loss_and_grads(fused, batch, fused_casts)
    assert abs(fused_loss - expected_loss) <= 2**-8 * abs(expected_loss)
    assert gradient_error(fused_grads, expected_grads) <= 1.25 * gradient_error(plain_grads, expected_grads)
    assert fused_casts.bytes < 0.5 * plain_casts.bytes, (fused_casts.bytes, plain_casts.bytes)

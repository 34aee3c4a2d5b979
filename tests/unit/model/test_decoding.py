"""The decoding engine (gpupoor/model/decoding.py) against transformers' own generate: the same greedy tokens in
fp32 for several prompts, batch sizes and left padding, with a LoRA adapter merged or switched off, ending at the
end-of-sequence token as generate does; its sampling seeded and filtered as the generation config says; the
models it does not cover left to generate."""

from __future__ import annotations

import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from gpupoor.model.decoding import decoder_for

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18], [19, 20, 21, 22, 23, 24, 25, 26, 27]]
PAD = 0


def llama(**overrides):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides)
    return LlamaForCausalLM(config).eval()


def qwen2():
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config).eval()
    for layer in model.model.layers:  # q/k/v biases: zero at init, where a bug would hide
        for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(projection.bias, std=0.5)
    return model


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def assert_same_greedy_tokens(model, prompts, new=24, eos=None):
    """The engine's tokens are generate's; where float rounding could flip a near-tie (a CPU's BLAS sums in
    another order), the first difference is allowed only at a top-2 gap under 1e-4 of the logits' scale."""
    ids, mask = left_padded(prompts)
    reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                               pad_token_id=PAD, eos_token_id=eos, output_scores=True, return_dict_in_generate=True)
    expected = reference.sequences[:, ids.shape[1]:]
    got = decoder_for(model).generate(ids, mask, new, eos, PAD)
    got = got[:, :expected.shape[1]]
    if torch.equal(got, expected):
        return
    row, step = (got != expected).nonzero()[0].tolist()
    scores = reference.scores[step][row].double()
    top = scores.topk(2).values
    assert float(top[0] - top[1]) < 1e-4 * float(scores.abs().max()), (row, step, got[row], expected[row])


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_greedy_tokens_are_generates_with_left_padding(batch):
    assert_same_greedy_tokens(llama(), PROMPTS[:batch])


def test_greedy_tokens_are_generates_for_qwen2_with_biases_and_one_key_value_head():
    assert_same_greedy_tokens(qwen2(), PROMPTS)


def test_rows_end_at_the_end_of_sequence_token_and_are_padded_after_it():
    model = llama()
    ids, mask = left_padded(PROMPTS)
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          pad_token_id=PAD)[:, ids.shape[1]:]
    eos = int(free[0, 3])  # a token the first row emits: it ends there
    assert_same_greedy_tokens(model, PROMPTS, new=12, eos=eos)
    got = decoder_for(model).generate(ids, mask, 12, eos, PAD)
    end = (got[0] == eos).nonzero()[0].item()
    assert end <= 3 and (got[0, end + 1:] == PAD).all()


@pytest.mark.parametrize("adapter_on", [True, False])
def test_a_lora_adapter_is_merged_into_the_weights_read_or_left_out_when_switched_off(adapter_on):
    model = get_peft_model(llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # zero at init: an adapter that changes nothing would pass either way
            torch.nn.init.normal_(parameter, std=0.5)
    model.eval()
    with model.disable_adapter() if not adapter_on else contextlib.nullcontext():
        assert_same_greedy_tokens(model, PROMPTS)
    ids, mask = left_padded(PROMPTS)
    with model.disable_adapter():
        off = decoder_for(model).generate(ids, mask, 16, None, PAD)
    on = decoder_for(model).generate(ids, mask, 16, None, PAD)
    assert not torch.equal(on, off)  # the adapter is read when on


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = llama()
    decoder = decoder_for(model)
    ids, mask = left_padded(PROMPTS)

    def sample(seed):
        return decoder.generate(ids, mask, 16, None, PAD, temperature=1.0,
                                generator=torch.Generator().manual_seed(seed))

    assert torch.equal(sample(3), sample(3)) and not torch.equal(sample(3), sample(4))
    decoder.top_k = 1
    assert torch.equal(sample(5), decoder.generate(ids, mask, 16, None, PAD))


def test_models_it_does_not_cover_are_left_to_generate():
    from peft import IA3Config

    dora = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True))
    ia3 = get_peft_model(llama(), IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                            feedforward_modules=["down_proj"]))
    gelu = llama(hidden_act="gelu")
    assert decoder_for(dora) is None and decoder_for(ia3) is None and decoder_for(gelu) is None
    # trained copies behind peft's wrappers: the engine would read the originals
    for saved in (["lm_head"], ["norm"], ["embed_tokens"]):
        wrapped = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=saved))
        assert decoder_for(wrapped) is None, saved
    embedding = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    assert decoder_for(embedding) is None
    assert decoder_for(llama()) is not None

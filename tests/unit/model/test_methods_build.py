"""The unit tier of test_methods.py (the tiers are described in tests/conftest.py)."""

from __future__ import annotations

import pytest

from support.cli import invoke

from support.methods import BATCH, _build, _saved_bytes


def test_a_quantized_base_cannot_be_fully_fine_tuned(make_recipe):
    result = invoke("validate", make_recipe(peft={"method": "full"}, quantization={"bits": 4}))
    assert result.exit_code == 2 and "'quantization'" in result.output and "cannot be fully fine-tuned" in result.output


@pytest.mark.parametrize("method", ["lora", "full"])
def test_frozen_layers_below_keep_no_activations(method, tiny_model):
    """Training the last of 2 layers saves about half the activations of training both: the frozen layer below
    needs no gradient, so autograd keeps nothing of it."""

    def saved(last_layers):
        model = _build(tiny_model, method, last_layers, False)
        # What the output head saves is the same either way: count the decoder layers' share only.
        head_only = _build(tiny_model, "full", None, False, modules_to_save=["lm_head"])
        return _saved_bytes(model, BATCH) - _saved_bytes(head_only, BATCH)

    every_layer, last_layer = saved(None), saved(1)
    assert 0 < last_layer <= 0.55 * every_layer, (last_layer, every_layer)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_with_checkpointing_frozen_layers_are_not_recomputed(method, tiny_model):
    """Checkpointed layers keep only their input and run again in backward; a frozen layer below the trainable
    ones keeps nothing and never runs again."""

    def backward_calls(last_layers) -> list[int]:
        model = _build(tiny_model, method, last_layers, True)
        layers = model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers
        calls = [0] * len(layers)
        # On a submodule: transformers checkpoints the layer's forward inside its own hooks, so the layer's hooks
        # see the forward only; the MLP's run again whenever the layer is recomputed.
        handles = [layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
                   for i, layer in enumerate(layers)]
        loss = model(**BATCH, use_cache=False).logits.float().sum()
        forward = list(calls)
        loss.backward()
        for handle in handles:
            handle.remove()
        return [after - before for after, before in zip(calls, forward)]

    assert backward_calls(None) == [1, 1]  # both layers recomputed for their gradients
    assert backward_calls(1) == [0, 1]  # the frozen layer is not

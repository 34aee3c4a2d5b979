"""model.kernels and model.compile (gpupoor.model.kernels): Liger's kernels are CUDA-only and say so on a CPU;
torch.compile of the decoder layers leaves the loss and the adapters' gradients as they were (to float32 rounding,
scaled to the tensors' norms) and the modules' names unchanged, so checkpoints load either way. The speed is
measured on a GPU (docs/benchmarks.md, "On a GPU"), not here."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from gpupoor.errors import UserError
from gpupoor.model.kernels import apply_kernels
from support.fused_layers import VOCAB, tiny_family, with_lora


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_liger_kernels_are_off_on_a_cpu_and_say_why():
    model = with_lora(tiny_family("llama", dtype=torch.float32))
    before = {n: type(m) for n, m in model.named_modules()}
    choice = apply_kernels(model, "liger", False)
    assert choice.value == "on" and "Liger kernels off" in choice.reason and "CUDA" in choice.reason
    assert {n: type(m) for n, m in model.named_modules()} == before  # nothing patched


def test_no_kernels_leave_the_model_as_it_is():
    model = with_lora(tiny_family("llama", dtype=torch.float32))
    choice = apply_kernels(model, "none", False)
    assert choice.value == "none" and "model.compile: false" in choice.reason


def test_a_missing_liger_package_is_a_clear_error_on_cuda(monkeypatch):
    import sys

    from gpupoor.model import kernels

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # the import fails as if not installed
    model = tiny_family("llama", dtype=torch.float32)
    with pytest.raises(UserError) as raised:
        kernels._apply_liger(model, "cuda")
    assert "model.kernels: liger" in str(raised.value) and "gpupoor[liger]" in raised.value.hint


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on a CPU needs a C compiler")
def test_compiled_layers_give_the_plain_loss_and_gradients():
    torch._dynamo.reset()
    plain = with_lora(tiny_family("llama", dtype=torch.float32, layers=1))
    compiled = copy.deepcopy(plain)
    choice = apply_kernels(compiled, "none", True)
    assert "torch.compile of 1 decoder layers" in choice.reason
    layer = compiled.get_base_model().model.layers[0]
    assert layer._compiled_call_impl is not None  # the layer itself runs compiled, under its own name
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in plain.named_parameters()]
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, grads = _loss_and_grads(plain, ids)
    loss_c, grads_c = _loss_and_grads(compiled, ids)
    assert abs(loss_c.item() - loss.item()) <= 1e-5 * abs(loss.item())
    assert grads.keys() == grads_c.keys() and grads
    for name, grad in grads.items():
        assert (grads_c[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-8, name

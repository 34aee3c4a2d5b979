"""LoRA linears and the gated MLP as single autograd functions, with the backward written out.

peft computes a LoRA linear as `base(x) + lora_B(lora_A(dropout(x))) * scaling`: four autograd nodes, and two
full-width elementwise passes (the scaling and the sum) each way. `LoraLinearFunction` does the same arithmetic as
`x W^T + s (x A^T) B^T` with the low-rank product accumulated into the base output by one addmm, saves only x and
the rank-wide x A^T, and writes the backward as four matmuls.

The gated MLP (`down(act(gate(x)) * up(x))`, llama / qwen2 / mistral / gemma) is where a decoder layer keeps most
of its activations: autograd saves gate(x), act(gate(x)), up(x) and their product, four intermediate-wide
tensors per token. `GatedMlpFunction` saves gate(x) and up(x) only and recomputes the activation and the product
in backward (elementwise: cheap next to the matmuls), so each layer keeps two intermediate-wide tensors fewer.

Both apply only where the arithmetic is plain LoRA on a frozen dense base: one active adapter, no dropout, no
DoRA, not merged, weights not quantized. Anything else (IA3, `full`, QLoRA's 4-bit base, adapters disabled for
a DPO reference pass) runs peft's own forward: the fused forward checks per call and hands over.

Both compute in the frozen base's dtype, whatever autocast says: fp32, or bf16 on a CPU with a bf16 base
(gpupoor.decisions.choose_fused_paths). There the fp32 LoRA factors (the master weights) are cast to bf16 once
per call, rank-wide and cheap, the input once if it is not bf16 already (it is: the base's norms return bf16), and
their gradients back to fp32: the only casts a fused layer makes. peft's LoRA under autocast casts the full-width
input to fp32 for the adapter and autocast casts it back, per adapted linear, forward and backward.
"""

from __future__ import annotations

import types

import torch
from torch import nn


class LowRank:
    """What one linear contributes: frozen weight and bias, and its LoRA factors with their scaling (or none)."""

    __slots__ = ("weight", "bias", "lora_a", "lora_b", "scaling")

    def __init__(self, weight, bias, lora_a=None, lora_b=None, scaling=0.0):
        self.weight, self.bias, self.lora_a, self.lora_b, self.scaling = weight, bias, lora_a, lora_b, scaling


def low_rank_of(module) -> LowRank | None:
    """`module`'s parts when it is a frozen nn.Linear or a peft LoRA linear whose forward is plain LoRA right now;
    None when it must run its own forward."""
    if type(module) is nn.Linear:
        return None if _trains(module) else LowRank(module.weight, module.bias)
    base = getattr(module, "base_layer", None)
    if type(base) is not nn.Linear or _trains(base) or not hasattr(module, "lora_A"):
        return None
    if module.disable_adapters or module.merged or len(module.active_adapters) != 1:
        return None
    name = module.active_adapters[0]
    if name not in module.lora_A or name in getattr(module, "lora_variant", {}):
        return None  # DoRA and other variants change the arithmetic
    if not isinstance(module.lora_dropout[name], nn.Identity):
        return None  # dropout > 0: a second input per call, peft's path
    lora_a, lora_b = module.lora_A[name].weight, module.lora_B[name].weight
    if lora_a.dtype not in (base.weight.dtype, torch.float32):
        return None
    return LowRank(base.weight, base.bias, lora_a, lora_b, float(module.scaling[name]))


def _trains(linear: nn.Linear) -> bool:
    return linear.weight.requires_grad or (linear.bias is not None and linear.bias.requires_grad)


def in_compute_dtype(part: LowRank) -> LowRank:
    """`part` with its LoRA factors in the frozen weight's dtype (the same tensors where they already are)."""
    dtype = part.weight.dtype
    if part.lora_a is None or part.lora_a.dtype == dtype:
        return part
    return LowRank(part.weight, part.bias, part.lora_a.to(dtype), part.lora_b.to(dtype), part.scaling)


def _forward(x2d, part: LowRank):
    """x W^T + b + s (x A^T) B^T, and x A^T (what B's gradient needs), for rows x2d; `part` in_compute_dtype."""
    if part.bias is not None:
        out = torch.addmm(part.bias, x2d, part.weight.t())
    else:
        out = x2d @ part.weight.t()
    if part.lora_a is None:
        return out, None
    xa = x2d @ part.lora_a.t()
    out.addmm_(xa, part.lora_b.t(), alpha=part.scaling)
    return out, xa


def _backward(grad_out, x2d, xa, part: LowRank, needs_a: bool, needs_b: bool, needs_in: bool = True):
    """The input's gradient, and A's and B's (None where not needed: the first layer's input needs none), in the
    compute dtype (`part` in_compute_dtype)."""
    grad_in = grad_out @ part.weight if needs_in else None
    if part.lora_a is None:
        return grad_in, None, None
    grad_low = (grad_out @ part.lora_b).mul_(part.scaling)  # rank-wide: the scaling costs nothing here
    if needs_in:
        grad_in.addmm_(grad_low, part.lora_a)
    grad_a = grad_low.t() @ x2d if needs_a else None
    grad_b = (grad_out.t() @ xa).mul_(part.scaling) if needs_b else None
    return grad_in, grad_a, grad_b


def _rows(x, dtype):
    """`x` as rows in the compute dtype: a view where it is already, one cast where not."""
    return x.reshape(-1, x.shape[-1]).to(dtype)


def _to(grad, dtype):
    """A gradient in the dtype of the tensor it belongs to (the fp32 master weights)."""
    return grad if grad is None else grad.to(dtype)


class LoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):
        part = in_compute_dtype(LowRank(weight, bias, lora_a, lora_b, scaling))
        x2d = _rows(x, weight.dtype)
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen here, not by autocast
            out, xa = _forward(x2d, part)
        ctx.save_for_backward(x2d, xa, weight, part.lora_a, part.lora_b)
        ctx.scaling, ctx.input_shape = scaling, x.shape
        ctx.dtypes = (x.dtype, lora_a.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2d, xa, weight, lora_a, lora_b = ctx.saved_tensors
        part = LowRank(weight, None, lora_a, lora_b, ctx.scaling)
        grad_rows = _rows(grad_out, weight.dtype)
        grad_in, grad_a, grad_b = _backward(grad_rows, x2d, xa, part, ctx.needs_input_grad[3],
                                            ctx.needs_input_grad[4], ctx.needs_input_grad[0])
        input_dtype, lora_dtype = ctx.dtypes
        grad_x = grad_in.view(ctx.input_shape).to(input_dtype) if grad_in is not None else None
        return grad_x, None, None, _to(grad_a, lora_dtype), _to(grad_b, lora_dtype), None


def lora_linear_forward(self, x, *args, **kwargs):
    """The forward installed on a peft LoRA linear: fused when the arithmetic is plain LoRA now, peft's otherwise."""
    part = low_rank_of(self) if not args and not kwargs else None
    if part is None or part.lora_a is None:
        return type(self).forward(self, x, *args, **kwargs)
    return LoraLinearFunction.apply(x, part.weight, part.bias, part.lora_a, part.lora_b, part.scaling)


class GatedMlpFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) with each of gate/up/down a frozen linear with or without LoRA."""

    @staticmethod
    def forward(ctx, x, act_fn, gate: LowRank, up: LowRank, down: LowRank, *trainable):
        # `trainable`: the LoRA factors (gate A, B, up A, B, down A, B; None where a linear has none), passed as
        # inputs so autograd routes their gradients.
        gate, up, down = (in_compute_dtype(part) for part in (gate, up, down))
        x2d = _rows(x, gate.weight.dtype)
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen here, not by autocast
            g, xa_gate = _forward(x2d, gate)
            u, xa_up = _forward(x2d, up)
            h = act_fn(g).mul_(u)
            out, xa_down = _forward(h, down)
        del h  # recomputed in backward from g and u
        ctx.save_for_backward(x2d, g, u, xa_gate, xa_up, xa_down)
        ctx.act_fn, ctx.parts, ctx.input_shape = act_fn, (gate, up, down), x.shape
        ctx.dtypes = (x.dtype, [t.dtype if t is not None else None for t in trainable])
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2d, g, u, xa_gate, xa_up, xa_down = ctx.saved_tensors
        gate, up, down = ctx.parts
        needs = ctx.needs_input_grad[5:]
        grad_out = grad_out.to(gate.weight.dtype)
        with torch.enable_grad():
            g_leaf = g.detach().requires_grad_()
            activated = ctx.act_fn(g_leaf)
        h = activated.detach() * u
        grad_h, grad_down_a, grad_down_b = _backward(grad_out.reshape(-1, grad_out.shape[-1]), h, xa_down, down,
                                                     needs[4], needs[5])
        del h
        grad_u = grad_h * activated.detach()
        (grad_g,) = torch.autograd.grad(activated, g_leaf, grad_h.mul_(u))
        del activated, g_leaf
        needs_x = ctx.needs_input_grad[0]
        grad_x, grad_gate_a, grad_gate_b = _backward(grad_g, x2d, xa_gate, gate, needs[0], needs[1], needs_x)
        del grad_g
        grad_x_up, grad_up_a, grad_up_b = _backward(grad_u, x2d, xa_up, up, needs[2], needs[3], needs_x)
        input_dtype, lora_dtypes = ctx.dtypes
        grad_x = grad_x.add_(grad_x_up).view(ctx.input_shape).to(input_dtype) if needs_x else None
        grads = (grad_gate_a, grad_gate_b, grad_up_a, grad_up_b, grad_down_a, grad_down_b)
        return (grad_x, None, None, None, None, *(_to(grad, dtype) for grad, dtype in zip(grads, lora_dtypes)))


def gated_mlp_forward(self, x):
    """The forward installed on a llama-style MLP: fused when gate, up and down are each a frozen linear or plain
    LoRA on one, the module's own otherwise."""
    parts = [low_rank_of(self.gate_proj), low_rank_of(self.up_proj), low_rank_of(self.down_proj)]
    if any(part is None for part in parts):
        return type(self).forward(self, x)
    trainable = [t for part in parts for t in (part.lora_a, part.lora_b)]
    return GatedMlpFunction.apply(x, self.act_fn, *parts, *trainable)


def fuse_lora_layers(model, mlp: bool = True) -> dict[str, int]:
    """Install the fused forwards on `model`'s LoRA linears and (unless not `mlp`: a benchmark's variant) gated
    MLPs, each checking per call whether it applies. Returns how many of each were installed."""
    counts = {"mlp": 0, "linear": 0}
    for module in model.modules():
        if mlp and _is_gated_mlp(module):
            module.forward = types.MethodType(gated_mlp_forward, module)
            counts["mlp"] += 1
        elif hasattr(module, "lora_A") and type(getattr(module, "base_layer", None)) is nn.Linear:
            # MLP projections too: they run this forward whenever their MLP hands over to its own.
            module.forward = types.MethodType(lora_linear_forward, module)
            counts["linear"] += 1
    return counts


def _is_gated_mlp(module) -> bool:
    """The llama-style gated MLP: gate_proj, up_proj, down_proj and act_fn, and nothing else to compute (the
    families' own classes; an MLP with other pieces keeps its forward)."""
    cls = type(module)
    return (cls.__name__, cls.__module__.rsplit(".", 1)[-1]) in GATED_MLPS and all(
        hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


# (class, module): the families' own MLPs, not a namesake of another model (qwen2_vl has a Qwen2MLP too).
GATED_MLPS = {("LlamaMLP", "modeling_llama"), ("Qwen2MLP", "modeling_qwen2"), ("MistralMLP", "modeling_mistral"),
              ("GemmaMLP", "modeling_gemma")}

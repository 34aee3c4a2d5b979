"""Attention over packed rows at the cost of the examples in them (sum of len^2), not of the row (max_len^2).

A packed row holds several examples back to back, told apart by position ids that restart at 0 (gpupoor.data.build).
transformers' SDPA path builds a (batch, 1, len, len) block-diagonal mask from those position ids and runs the
whole row through one masked kernel: every query meets every key, and the CPU kernel cannot skip the masked
blocks. This backend cuts the rows into their examples and runs them through SDPA with `is_causal=True`, examples
of similar length padded into one batch, so the work is about the examples' own triangles and no mask is built.
Padding masks and a KV cache (generation) go to transformers' own SDPA function with the mask transformers
builds; attention dropout and a sliding window shorter than an example go there with the block-diagonal mask
built here. So the backend is safe to leave on.

It is registered with transformers' AttentionInterface / AttentionMaskInterface under NAME, and a model uses it by
`use_packed_attention` when gpupoor.decisions.choose_fused_paths allows: a family it is tested on (FUSED_FAMILIES:
plain scaled dot-product attention, no logit soft-capping, position_ids passed through to the attention function)
loaded with sdpa.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


NAME = "gpupoor_packed_sdpa"


def segment_lengths(position_ids: torch.Tensor) -> list[int]:
    """The examples of a (batch, len) block of position ids, row after row: a new one starts wherever the position
    does not follow the previous one (transformers' own rule for packed rows)."""
    rows, length = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    flat = starts.reshape(-1).nonzero().flatten().tolist()
    bounds = flat + [rows * length]
    # A row boundary always starts an example: starts[:, 0] is True.
    return [end - start for start, end in zip(bounds, bounds[1:])]


_last_segments: tuple[torch.Tensor | None, list[int]] = (None, [])


def _segments(position_ids: torch.Tensor, batch: int) -> list[int]:
    """segment_lengths, once per forward: every layer gets the same position_ids tensor."""
    global _last_segments
    cached, lengths = _last_segments
    if cached is not position_ids:
        # The position ids are sometimes one row for the whole batch (unsqueezed, not expanded).
        lengths = segment_lengths(position_ids.expand(batch, -1))
        _last_segments = (position_ids, lengths)
    return lengths


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: query (batch, heads, len, dim), key/value (batch, kv_heads,
    len, dim); returns (batch, len, heads, dim) and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    same_length = query.shape[2] == key.shape[2]
    if attention_mask is not None and query.shape[2] > 1 and _plain_sdpa(kwargs):
        return masked_shared_heads(query, key, value, attention_mask, dropout, scaling)
    if attention_mask is not None or not same_length:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if position_ids is None:
        lengths = [length] * batch
    else:
        lengths = _segments(position_ids, batch)
    if dropout or (window is not None and max(lengths) > window):
        return _explicit_mask(module, query, key, value, lengths, window, scaling, dropout, kwargs)
    if torch.is_autocast_enabled(query.device.type):
        # What autocast does for F.scaled_dot_product_attention: the kernels below are not on its lists.
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    # Rows laid end to end: (batch * len, heads, dim); each example a slice of them.
    q_rows = query.transpose(1, 2).reshape(batch * length, heads, dim)
    k_rows = key.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    v_rows = value.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    out = PerExampleAttention.apply(q_rows, k_rows, v_rows, tuple(lengths), scaling)
    return out.view(batch, length, heads, dim), None


# Examples whose lengths are within this ratio of their group's longest share one SDPA call, padded to it. A
# 512-token row packs ~10 examples of a few dozen tokens, and each call has a fixed cost: on the real model's
# shapes one call per example took 12% longer than groups at 0.75, which beat 1.0, 0.5 and one padded batch (0)
# (docs/benchmarks.md). Padding to the longest of a group wastes at most 1 - GROUP_RATIO^2 of that group's work.
GROUP_RATIO = 0.75


class ExampleGroups:
    """The examples of rows laid end to end, in groups of similar length (longest first; each group every example
    down to `ratio` of its longest), and where each row goes in the groups' padded layout: group after group,
    each a (count, longest) batch. `gather` picks that layout out of the rows (padding repeats row 0: with right
    padding and a causal mask no real query ever sees a padding key), `inverse` picks the rows back out of it,
    `pads` are the padding positions (their incoming gradient must be zero: padding queries see real keys)."""

    def __init__(self, lengths: tuple[int, ...], device, ratio: float):
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups, members = [], []
        for i in order:
            if members and lengths[i] < ratio * lengths[members[0]]:
                groups.append(members)
                members = []
            members.append(i)
        groups.append(members)
        self.shapes: list[tuple[int, int]] = []  # (count, longest) of each group, in layout order
        gather, pads, inverse = [], [], [0] * sum(lengths)
        for members in groups:
            longest = lengths[members[0]]
            self.shapes.append((len(members), longest))
            for i in members:
                at = len(gather)
                gather += range(starts[i], starts[i] + lengths[i])
                inverse[starts[i]:starts[i] + lengths[i]] = range(at, at + lengths[i])
                pads += range(len(gather), len(gather) + longest - lengths[i])
                gather += [0] * (longest - lengths[i])
        as_index = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        self.gather, self.inverse = as_index(gather), as_index(inverse)
        self.pads = as_index(pads) if pads else None

    def batches(self, padded: torch.Tensor):
        """Each group's (count, heads, longest, dim) view of a tensor in the padded layout."""
        offset = 0
        for count, longest in self.shapes:
            size = count * longest
            yield padded[offset:offset + size].view(count, longest, *padded.shape[1:]).transpose(1, 2)
            offset += size


def example_groups(lengths: tuple[int, ...], device, ratio: float | None = None) -> ExampleGroups:
    """ExampleGroups for `lengths`, built once per forward: every layer (and its backward) has the same."""
    key = (lengths, str(device), GROUP_RATIO if ratio is None else ratio)
    if _group_cache.get("key") != key:
        _group_cache.update(key=key, groups=ExampleGroups(lengths, device, key[2]))
    return _group_cache["groups"]


_group_cache: dict = {}


def _causal(q, k, v, scaling):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _cpu_flash_ops():
    """torch's CPU flash-attention kernel and its backward as ops (forward returning the log-sum-exp), or None
    where this torch has none: then backward recomputes the forward through F.scaled_dot_product_attention."""
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
    ops = [getattr(torch.ops.aten, name, None) for name in names]
    return None if None in ops else ops


_CPU_FLASH = _cpu_flash_ops()


class PerExampleAttention(torch.autograd.Function):
    """Causal attention within each example of rows laid end to end, examples of similar length batched
    (ExampleGroups).

    On the CPU it calls the flash kernel and its backward directly and keeps q, k, v, the output and the
    log-sum-exp: the output is the tensor o_proj receives, so where o_proj keeps its input for backward (an
    adapted o_proj) one copy serves both, and backward runs no second forward (measured: attention 17% faster).
    Elsewhere (a GPU) it keeps q, k and v and recomputes the attention in backward."""

    @staticmethod
    def forward(ctx, q_rows, k_rows, v_rows, lengths, scaling):
        groups = example_groups(lengths, q_rows.device)
        flash = _CPU_FLASH is not None and q_rows.device.type == "cpu"
        kernel = _kernel_dtype(q_rows, flash)
        padded = [t.index_select(0, groups.gather).to(kernel) for t in (q_rows, k_rows, v_rows)]
        out = torch.empty_like(padded[0])
        log_sum_exps = []
        for out_batch, *batch in zip(*(groups.batches(t) for t in (out, *padded))):
            if flash:
                group_out, log_sum_exp = _CPU_FLASH[0](*batch, 0.0, True, scale=scaling)
                log_sum_exps.append(log_sum_exp)
            else:
                group_out = _causal(*batch, scaling)
            out_batch.copy_(group_out)
        out = out.index_select(0, groups.inverse).to(q_rows.dtype)
        ctx.save_for_backward(q_rows, k_rows, v_rows, *((out, *log_sum_exps) if flash else ()))
        ctx.lengths, ctx.scaling, ctx.flash, ctx.kernel = lengths, scaling, flash, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        groups = example_groups(ctx.lengths, grad_out.device)
        saved = ctx.saved_tensors
        inputs = saved[:4] if ctx.flash else saved[:3]
        padded = [t.index_select(0, groups.gather).to(ctx.kernel) for t in inputs]
        grad_padded = grad_out.index_select(0, groups.gather).to(ctx.kernel)
        if groups.pads is not None:
            grad_padded.index_fill_(0, groups.pads, 0)
        grads = [torch.empty_like(t) for t in padded[:3]]
        batches = zip(*(groups.batches(t) for t in (grad_padded, *grads, *padded)))
        for group, (grad_batch, *rest) in enumerate(batches):
            targets, batch = rest[:3], rest[3:]
            if ctx.flash:
                group_grads = _CPU_FLASH[1](grad_batch, *batch, saved[4 + group], 0.0, True, scale=ctx.scaling)
            else:
                with torch.enable_grad():
                    leaves = [t.detach().requires_grad_() for t in batch]
                    group_out = _causal(*leaves, ctx.scaling)
                group_grads = torch.autograd.grad(group_out, leaves, grad_batch)
            for target, grad in zip(targets, group_grads):
                target.copy_(grad)
        return *(grad.index_select(0, groups.inverse).to(t.dtype) for grad, t in zip(grads, inputs)), None, None


BF16_IN_FP32 = True  # see _kernel_dtype


def _kernel_dtype(q_rows: torch.Tensor, flash: bool) -> torch.dtype:
    """The dtype the CPU flash kernel runs in: bf16 inputs go through it in fp32, since its bf16 path is the slower
    one (forward and backward on the real model's shapes, 9 heads of 64 over 11 examples of 80 tokens: 12.2 ms in
    bf16, 5.2 ms cast to fp32 and back, on an Intel Xeon with AMX; 5x at the demo's 16-wide heads). What is
    saved for backward stays in bf16 (the casts are redone there), so the activations are what they were."""
    return torch.float32 if BF16_IN_FP32 and flash and q_rows.dtype == torch.bfloat16 else q_rows.dtype


def _plain_sdpa(kwargs) -> bool:
    """Nothing transformers' SDPA function would add to the plain call: no position bias, no soft-capping."""
    return kwargs.get("position_bias") is None and kwargs.get("softcap") is None


def masked_shared_heads(query, key, value, attention_mask, dropout: float, scaling):
    """Masked attention of several queries a row (padded rows, GRPO's answers after their prompt's cache), each
    key and value head shared by its group of query heads inside SDPA (enable_gqa). transformers' SDPA function
    repeats them to every query head first when a mask is given (repeat_kv), and autograd keeps the copies for
    backward: heads / kv_heads times the keys and values a layer (3x on SmolLM2; 306 MiB against 102 in the GRPO
    demo's update). The same arithmetic: outputs equal, gradients to float rounding (tests/unit/model/test_fused_layers.py)."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _explicit_mask(module, query, key, value, lengths, window, scaling, dropout, kwargs):
    """Attention dropout, or an example longer than a sliding window (Mistral's 4,096, when a recipe packs longer
    rows): the block-diagonal (banded) mask built explicitly, through transformers' SDPA function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, _, length, _ = query.shape
    example = torch.repeat_interleave(torch.arange(len(lengths), device=query.device),
                                      torch.tensor(lengths, device=query.device)).view(batch, length)
    index = torch.arange(length, device=query.device)
    allowed = index[None, :] <= index[:, None]
    if window is not None:
        allowed = allowed & (index[:, None] - index[None, :] < window)
    mask = (example[:, :, None] == example[:, None, :]) & allowed
    return sdpa_attention_forward(module, query, key, value, mask[:, None], dropout=dropout, scaling=scaling,
                                  **kwargs)


def packed_mask(*args, attention_mask=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, **kwargs):
    """No mask when the batch carries none and nothing is cached (training rows: the attention function reads
    position_ids); otherwise the mask transformers' SDPA path would build."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length and not _nonzero(q_offset) and not _nonzero(kv_offset):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, **kwargs)


def _nonzero(offset) -> bool:
    return bool(offset != 0) if isinstance(offset, torch.Tensor) else offset != 0


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, packed_mask)


def use_packed_attention(model) -> None:
    """Switch `model` (loaded with sdpa; gpupoor.decisions.choose_fused_paths says when) to this backend."""
    register()
    model.set_attn_implementation(NAME)

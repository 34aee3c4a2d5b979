"""Attention over packed rows at the cost of the examples in them (sum of len^2), not of the row (max_len^2).

A packed row holds several examples back to back, told apart by position ids that restart at 0 (gpupoor.data.build).
transformers' SDPA path builds a (batch, 1, len, len) block-diagonal mask from those position ids and runs the
whole row through one masked kernel: every query meets every key, and the CPU kernel cannot skip the masked
blocks. This backend cuts the row into its examples and runs each through SDPA with `is_causal=True`, so the work
is the examples' own triangles and no mask is built. Padding masks and a KV cache (generation) go to
transformers' own SDPA function with the mask transformers builds; attention dropout and a sliding window shorter
than an example go there with the block-diagonal mask built here. So the backend is safe to leave on.

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
    # Rows laid end to end: (batch * len, heads, dim); each example a slice of them.
    q_rows = query.transpose(1, 2).reshape(batch * length, heads, dim)
    k_rows = key.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    v_rows = value.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    out = PerExampleAttention.apply(q_rows, k_rows, v_rows, tuple(lengths), scaling)
    return out.view(batch, length, heads, dim), None


def _example_attention(q, k, v, scaling):
    """Causal SDPA over one example's rows (len, heads, dim) -> (len, heads, dim)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


class PerExampleAttention(torch.autograd.Function):
    """Causal attention within each example of rows laid end to end. Keeps q, k and v for backward and
    recomputes each example's attention there (sum of len^2 again: small next to the layer's matmuls) instead of
    keeping the output and log-sum-exp: o_proj keeps the output already, and one copy is enough."""

    @staticmethod
    def forward(ctx, q_rows, k_rows, v_rows, lengths, scaling):
        out = torch.empty_like(q_rows)
        start = 0
        for length in lengths:
            end = start + length
            out[start:end] = _example_attention(q_rows[start:end], k_rows[start:end], v_rows[start:end], scaling)
            start = end
        ctx.save_for_backward(q_rows, k_rows, v_rows)
        ctx.lengths, ctx.scaling = lengths, scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_rows, k_rows, v_rows = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (q_rows, k_rows, v_rows)]
        start = 0
        for length in ctx.lengths:
            end = start + length
            with torch.enable_grad():
                pieces = [t[start:end].detach().requires_grad_() for t in (q_rows, k_rows, v_rows)]
                out = _example_attention(*pieces, ctx.scaling)
            piece_grads = torch.autograd.grad(out, pieces, grad_out[start:end])
            for grad, piece in zip(grads, piece_grads):
                grad[start:end] = piece
            start = end
        return *grads, None, None


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

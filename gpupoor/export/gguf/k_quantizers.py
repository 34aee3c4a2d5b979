"""The GGUF types the gguf package reads but cannot write: Q4_K, Q5_K, Q6_K and IQ4_NL, in numpy.

Each is ggml's reference quantizer (ggml/src/ggml-quants.c: quantize_row_q4_K_ref, quantize_row_q5_K_ref,
quantize_row_q6_K_ref; quantize_iq4_nl with ntry=7; what llama-quantize runs without an imatrix) redone in float32
operation for operation, so the bytes are ggml's: sums added in C's order (numpy's own sum pairs the terms, and the
last-bit differences flip near-ties between candidate scales in a few percent of blocks), round-half-to-even like
nearest_int, and values requantized against the scales as rounded to fp16. A ggml compiled with fused multiply-add
(gcc -march=native on x86) rounds its sums differently and so differs in some blocks too, at the same quality.
Work is vectorised over blocks: Python loops run over the candidate scales, and over the values of one
(sub-)block for the sums.

Relative RMSE on N(0, 1) data (2**20 values): Q6_K 0.0177, Q5_K 0.0361, Q4_K 0.0713, IQ4_NL 0.0761; the gguf
package's Q4_0 0.0860 and Q4_1 0.0782 for comparison.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)  # below this a (sub-)block counts as all zero, as in ggml
CHUNK_VALUES = 1 << 18  # values quantized at a time: a few MB of temporaries, whatever the matrix

IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
# best_index_int8 picks level i once 2x reaches values[i-1] + values[i]. Those sums are integers, so floor(2x)
# decides exactly, and tables indexed by it give the level (and its value) without a search.
_MIDPOINTS2 = IQ4_NL_VALUES[:-1].astype(np.int32) + IQ4_NL_VALUES[1:]
_FLOOR_LO, _FLOOR_HI = int(_MIDPOINTS2[0]) - 1, int(_MIDPOINTS2[-1])
_LEVEL_OF_FLOOR = np.searchsorted(_MIDPOINTS2, np.arange(_FLOOR_LO, _FLOOR_HI + 1), side="right").astype(np.uint8)
_VALUE_OF_FLOOR = IQ4_NL_VALUES.astype(F32)[_LEVEL_OF_FLOOR]


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """The sum over axis 0 in index order, as C's `for (i = 0; i < n; ++i) s += t[i]` adds in float32."""
    total = terms[0].copy()
    for term in terms[1:]:
        total += term
    return total


def _fp16_round(values: np.ndarray) -> np.ndarray:
    """The float32 value of ggml's fp16 (round to nearest even): ggml requantizes against the stored scale."""
    return values.astype(np.float16).astype(F32)


def _le16(values: np.ndarray) -> np.ndarray:
    """fp16 little-endian bytes, (B,) -> (B, 2)."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _make_qkx2_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int):
    """ggml's make_qkx2_quants on S sub-blocks at once. x, w: (n, S) values and weights, one sub-block per column.
    Returns the levels L (n, S) in [0, nmax] as float32, the scales (S,) and the mins (S,), where a sub-block
    reads back as scale * L - min. The search tries nstep + 1 scales, each fitted by weighted least squares."""
    low = np.minimum(x.min(axis=0), 0)
    high = x.max(axis=0)
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    nmax = F32(nmax)
    first_iscale = nmax / (high - low)
    # max == min, or a range so small (subnormal) that nmax/range overflows: either way C ends with scale 0, L = 0
    flat = ~np.isfinite(first_iscale)
    levels, work = np.empty_like(x), np.empty_like(x)  # in-place work: this loop is most of the time

    def fill_levels(iscale, low):
        np.subtract(x, low, out=levels)
        np.multiply(levels, iscale, out=levels)
        np.rint(levels, out=levels)
        np.clip(levels, 0, nmax, out=levels)

    def weighted_error(scale, low):  # sum of w * (scale*L + low - x)^2, in C's order of operations
        np.multiply(levels, scale, out=work)
        np.add(work, low, out=work)
        np.subtract(work, x, out=work)
        np.square(work, out=work)
        np.multiply(work, w, out=work)
        return _seq_sum(work)

    # the search remembers the winner's iscale and start, and rebuilds its levels once at the end
    chosen_iscale, chosen_low = first_iscale, low
    scale = F32(1) / chosen_iscale
    fill_levels(chosen_iscale, low)
    best = weighted_error(scale, low)
    for step in range(nstep + 1):
        # `low` moves to each better fit's min, and the next candidate's levels start from it, as in C
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + nmax) / (high - low)
        fill_levels(iscale, low)
        np.multiply(w, levels, out=work)
        sum_l, sum_xl = _seq_sum(work), _seq_sum(work * x)
        work *= levels
        sum_l2 = _seq_sum(work)
        det = sum_w * sum_l2 - sum_l * sum_l
        trial_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        trial_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = trial_min > 0  # a positive min would waste a level: refit through zero instead
        trial_scale = np.where(positive, sum_xl / sum_l2, trial_scale)
        trial_min = np.where(positive, F32(0), trial_min)
        trial_error = weighted_error(trial_scale, trial_min)
        better = (det > 0) & (trial_error < best)
        best = np.where(better, trial_error, best)
        chosen_iscale, chosen_low = np.where(better, iscale, chosen_iscale), np.where(better, low, chosen_low)
        scale = np.where(better, trial_scale, scale)
        low = np.where(better, trial_min, low)
    fill_levels(chosen_iscale, chosen_low)
    levels[:, flat] = 0
    return levels, np.where(flat, F32(0), scale), -low


def _six_bit(values: np.ndarray, largest: np.ndarray) -> np.ndarray:
    """The sub-block scales (B, 8) as 6-bit multiples of largest/63 (C stores nearest_int in a uint8, then caps)."""
    inverse = np.where(largest > 0, F32(63) / largest, F32(0))
    rounded = np.rint(inverse[:, None] * values).astype(np.int64) & 0xFF
    return np.minimum(rounded, 63).astype(np.uint8)


def scale_min_choice(blocks: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """What Q4_K (nmax 15) and Q5_K (nmax 31) choose for 256-blocks (B, 256): fp16 d and dmin (as float32, (B,)),
    6-bit scales and mins of the 8 sub-blocks of 32 ((B, 8) uint8), levels (B, 8, 32) uint8. A value reads
    d*scale*level - dmin*min."""
    n_blocks = len(blocks)
    x = np.ascontiguousarray(blocks.reshape(n_blocks * 8, 32).T)
    w = np.sqrt(_seq_sum(x * x) / F32(32)) + np.abs(x)
    L, scales, mins = _make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(n_blocks, 8), mins.reshape(n_blocks, 8)
    max_scale, max_min = np.maximum(scales.max(axis=1), 0), np.maximum(mins.max(axis=1), 0)
    ls, lm = _six_bit(scales, max_scale), _six_bit(mins, max_min)
    d, dmin = _fp16_round(max_scale / F32(63)), _fp16_round(max_min / F32(63))
    sub_d = (d[:, None] * ls).reshape(-1)
    sub_min = (dmin[:, None] * lm).reshape(-1)
    requantized = np.clip(np.rint((x + sub_min) / sub_d), 0, F32(nmax))
    keep = sub_d == 0  # a zero scale keeps the search's levels, as C does
    requantized[:, keep] = L[:, keep]
    return d, dmin, ls, lm, requantized.T.astype(np.uint8).reshape(n_blocks, 8, 32)


def _k_header(d: np.ndarray, dmin: np.ndarray, ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's first 16 bytes: d, dmin, and the eight 6-bit scales and mins packed in 12 bytes the way
    ggml's get_scale_min_k4 reads them (sub-blocks 4-7 keep their top two bits in bytes 0-7)."""
    return np.concatenate([_le16(d), _le16(dmin),
                           ls[:, :4] | (ls[:, 4:] >> 4) << 6,
                           lm[:, :4] | (lm[:, 4:] >> 4) << 6,
                           (ls[:, 4:] & 0xF) | (lm[:, 4:] & 0xF) << 4], axis=1)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """(B, 256) float32 -> (B, 144) block_q4_K: d, dmin, scales[12], qs[128] (sub-blocks 2c and 2c+1 share
    the 32 bytes of chunk c, low and high nibble)."""
    d, dmin, ls, lm, L = scale_min_choice(blocks, 15, -1.0, 0.1, 20)
    qs = L[:, 0::2] | L[:, 1::2] << 4
    return np.concatenate([_k_header(d, dmin, ls, lm), qs.reshape(len(blocks), 128)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """(B, 256) float32 -> (B, 176) block_q5_K: d, dmin, scales[12], qh[32] (bit j: the fifth bit of sub-block
    j's value), qs[128] (the low four bits, laid out as Q4_K's)."""
    d, dmin, ls, lm, L = scale_min_choice(blocks, 31, -0.5, 0.1, 15)
    qh = np.bitwise_or.reduce((L >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    low = L & 0xF
    qs = low[:, 0::2] | low[:, 1::2] << 4
    return np.concatenate([_k_header(d, dmin, ls, lm), qh, qs.reshape(len(blocks), 128)], axis=1)


def _make_qx_quants(x: np.ndarray, nmax: int):
    """ggml's make_qx_quants with rmse_type 1 and no importance weights, on S sub-blocks at once (x: (n, S)).
    Returns levels (n, S) in [0, 2*nmax) as float32 and the signed scales (S,): a value reads scale*(L - nmax)."""
    largest = np.take_along_axis(x, np.abs(x).argmax(axis=0)[None], axis=0)[0]  # signed, first of equals
    w = x * x
    wx, nmax = w * x, F32(nmax)
    levels, work = np.empty_like(x), np.empty_like(x)

    def fit(iscale):  # sum of w*x*l and of w*l*l, in C's order of operations
        np.multiply(x, iscale, out=levels)
        np.rint(levels, out=levels)
        np.clip(levels, -nmax, nmax - 1, out=levels)
        np.multiply(wx, levels, out=work)
        sumlx = _seq_sum(work)
        np.multiply(w, levels, out=work)
        np.multiply(work, levels, out=work)
        return sumlx, _seq_sum(work)

    chosen_iscale = -nmax / largest
    sumlx, suml2 = fit(chosen_iscale)
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        iscale = -(nmax + F32(0.1) * F32(step)) / largest
        sumlx, suml2 = fit(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        chosen_iscale = np.where(better, iscale, chosen_iscale)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    fit(chosen_iscale)  # the winner's levels, rebuilt once
    levels += nmax
    zero = np.abs(largest) < GROUP_MAX_EPS  # C: L = 0 (not nmax) and scale 0
    levels[:, zero] = 0
    return levels, np.where(zero, F32(0), scale)


def q6_k_choice(blocks: np.ndarray):
    """What Q6_K chooses for 256-blocks (B, 256): fp16 d (as float32, (B,)), int8 scales of the 16 sub-blocks
    of 16 ((B, 16)), levels (B, 256) uint8 in [0, 63]. A value reads d*scale*(level - 32)."""
    n_blocks = len(blocks)
    x = np.ascontiguousarray(blocks.reshape(n_blocks * 16, 16).T)
    L, scales = _make_qx_quants(x, 32)
    scales = scales.reshape(n_blocks, 16)
    max_scale = np.take_along_axis(scales, np.abs(scales).argmax(axis=1)[:, None], axis=1)[:, 0]
    zero = np.abs(max_scale) < GROUP_MAX_EPS  # C writes such a block as all zero bytes
    iscale = F32(-128) / max_scale
    d = _fp16_round(F32(1) / iscale)
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127).astype(np.int8)
    sub_d = (d[:, None] * sc).reshape(-1)
    requantized = np.clip(np.rint(x / sub_d), -32, 31) + F32(32)
    keep = sub_d == 0  # a zero scale keeps the search's levels, as C does
    requantized[:, keep] = L[:, keep]
    levels = requantized.T.astype(np.uint8).reshape(n_blocks, 256)
    d[zero], sc[zero], levels[zero] = 0, 0, 0
    return d, sc, levels


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """(B, 256) float32 -> (B, 210) block_q6_K: ql[128], qh[64], int8 scales[16], d (last). Per half of 128
    values, ql holds the low nibbles of quarters 0|2 and 1|3, qh the top two bits of all four quarters."""
    d, sc, L = q6_k_choice(blocks)
    q = L.reshape(len(blocks), 2, 4, 32)
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4],
                        axis=2)
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _le16(d)], axis=1)


def _iq4_nl_floor_index(doubled: np.ndarray) -> np.ndarray:
    """Where each 2x falls in the _*_OF_FLOOR tables: ggml's best_index_int8 (ties go to the upper level)."""
    index = np.floor(doubled)
    index -= _FLOOR_LO
    np.clip(index, 0, _FLOOR_HI - _FLOOR_LO, out=index)
    return index.astype(np.uint16)


def iq4_nl_choice(blocks: np.ndarray):
    """What IQ4_NL chooses for 32-blocks (B, 32): the scale d (float32, (B,); stored as fp16) and levels (B, 32)
    uint8 into IQ4_NL_VALUES, a 16-level non-uniform codebook. The scale is the best weighted least-squares fit
    (weights x^2) over 16 candidate level assignments (quantize_row_iq4_nl_impl with ntry=7)."""
    x = np.ascontiguousarray(blocks.T)
    largest = np.take_along_axis(x, np.abs(x).argmax(axis=0)[None], axis=0)[0]
    zero = np.abs(largest) < GROUP_MAX_EPS
    largest[zero] = 1  # an all-zero block's fits are thrown away: this only keeps 0 * inf out of them
    w = x * x

    def fit(inverse_scale):  # sum of w*q*x and of w*q*q, in C's order of operations
        # 2 * (id * x) == (2 * id) * x exactly: doubling only moves the exponent
        q = np.take(_VALUE_OF_FLOOR, _iq4_nl_floor_index((inverse_scale + inverse_scale) * x))
        wq = w * q
        sumqx = _seq_sum(wq * x)
        np.multiply(wq, q, out=wq)
        return sumqx, _seq_sum(wq)

    sumqx, sumq2 = fit(F32(1) / (-largest / F32(IQ4_NL_VALUES[0])))
    d = np.where(sumq2 > 0, sumqx / sumq2, F32(0))
    best = d * sumqx
    for step in range(-7, 8):
        sumqx, sumq2 = fit(F32(step + int(IQ4_NL_VALUES[0])) / largest)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / sumq2, d)
        best = np.where(better, d * sumqx, best)
    d[zero] = 0
    # the levels are picked again against the float32 scale (not its fp16 rounding), as C does
    inverse = np.where(d != 0, F32(1) / d, F32(0))
    return d, np.take(_LEVEL_OF_FLOOR, _iq4_nl_floor_index((inverse + inverse) * x)).T


def quantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """(B, 32) float32 -> (B, 18) block_iq4_nl: d, qs[16] (values j and 16 + j in the low and high nibble)."""
    d, L = iq4_nl_choice(blocks)
    return np.concatenate([_le16(d), L[:, :16] | L[:, 16:] << 4], axis=1)


# each takes float32 blocks (B, block size) and gives their bytes (B, type size)
QUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
    GGMLQuantizationType.IQ4_NL: quantize_iq4_nl,
}


def quantize(weights: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A float32 matrix (rows, n) as the uint8 (rows, n // block * type_size) that
    `gguf.GGUFWriter.add_tensor(name, result, raw_dtype=qtype)` writes and `gguf.quants.dequantize` reads back.
    n must be a multiple of the type's block: 256 for the K types, 32 for IQ4_NL."""
    if qtype not in QUANTIZERS:
        written = ", ".join(t.name for t in QUANTIZERS)
        raise ValueError(f"{qtype!r} is not a type this module writes (it writes {written})")
    weights = np.asarray(weights)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if weights.ndim != 2 or weights.shape[1] % block != 0:
        raise ValueError(f"{qtype.name} needs a 2-D (rows, n) array with n a multiple of {block}, "
                         f"got shape {weights.shape}")
    if not np.issubdtype(weights.dtype, np.floating):
        raise ValueError(f"{qtype.name} quantizes floats, got {weights.dtype}")
    blocks = weights.reshape(-1, block)
    out = np.empty((len(blocks), type_size), dtype=np.uint8)
    step = max(1, CHUNK_VALUES // block)
    # ggml relies on IEEE results where a scale is 0 or inf (masked out afterwards), so numpy must not warn
    with np.errstate(all="ignore"):
        for start in range(0, len(blocks), step):
            chunk = blocks[start:start + step].astype(F32)
            if not np.isfinite(chunk).all():  # ggml would write garbage scales: no block means anything here
                raise ValueError(f"{qtype.name}: the weights contain NaN or infinity")
            out[start:start + step] = QUANTIZERS[qtype](chunk)
    return out.reshape(weights.shape[0], weights.shape[1] // block * type_size)

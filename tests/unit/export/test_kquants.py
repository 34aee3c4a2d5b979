"""gpupoor.export.gguf.k_quantizers writes Q4_K, Q5_K, Q6_K and IQ4_NL as ggml does, byte for byte.

The reference bytes in data/kquants_reference.npz come from ggml's own C: quantize_row_q4_K_ref,
quantize_row_q5_K_ref, quantize_row_q6_K_ref and quantize_iq4_nl (quantize_row_iq4_nl_impl with ntry=7), with
make_qkx2_quants, make_qx_quants, nearest_int, best_index_int8 and the portable fp16 conversions, copied from
llama.cpp's ggml/src/ggml-quants.c, ggml-common.h and ggml-impl.h at commit
01243c587feceaa5d6a6c2305535ef2f549c48b8 into a small harness built with `gcc -O2 -ffp-contract=off` (IEEE float32
in source order, no fused multiply-add). Its input `x` is stored beside the bytes: 32 rows of 256 float32 drawn
from numpy's default_rng(20240529) and made into Gaussian, heavy-tailed, all-zero, constant, outlier, tiny (below
ggml's 1e-15; subnormal; fp16-underflowing), all-positive, tied and widely scaled rows. The same harness and this
module agreed on every one of 163,840 random blocks per K type and 1,310,720 IQ4_NL blocks, so no block here may
differ.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from gpupoor.export.gguf import k_quantizers as kquants

TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL)
REFERENCE = Path(__file__).parent / "data" / "kquants_reference.npz"


def gaussian(rows: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, n)).astype(np.float32)


def relative_rmse(x: np.ndarray, qtype, quantizer=kquants.quantize) -> float:
    y = gguf.quants.dequantize(quantizer(x, qtype), qtype)
    return float(np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2)))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_bytes_are_ggmls_reference_bytes(qtype):
    reference = np.load(REFERENCE)
    ours = kquants.quantize(reference["x"], qtype)
    expected = reference[qtype.name]
    assert ours.shape == expected.shape
    type_size = GGML_QUANT_SIZES[qtype][1]
    differing = np.flatnonzero((ours.reshape(-1, type_size) != expected.reshape(-1, type_size)).any(axis=1))
    assert differing.size == 0, f"{qtype.name} blocks {differing.tolist()} differ from ggml's"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [256, 512, 1024])
def test_each_row_has_the_bytes_gguf_expects(qtype, n):
    block, type_size = GGML_QUANT_SIZES[qtype]
    out = kquants.quantize(gaussian(3, n), qtype)
    assert out.dtype == np.uint8 and out.shape == (3, n // block * type_size)
    assert gguf.quants.dequantize(out, qtype).shape == (3, n)


def test_gguf_reads_back_exactly_the_values_chosen():
    """Decoding our bytes with the gguf package gives the values the choice functions picked, to the bit: the
    packing puts every level and scale where gguf (and ggml) read it. Products in gguf's order."""
    x = gaussian(40, 256, seed=1) * np.float32(0.05)
    blocks = x.reshape(-1, 256)
    for qtype, nmax, search in ((T.Q4_K, 15, (-1.0, 0.1, 20)), (T.Q5_K, 31, (-0.5, 0.1, 15))):
        d, dmin, ls, lm, L = kquants.scale_min_choice(blocks, nmax, *search)
        chosen = (d[:, None] * ls)[..., None] * L.astype(np.float32) - (dmin[:, None] * lm)[..., None]
        read = gguf.quants.dequantize(kquants.quantize(x, qtype), qtype)
        np.testing.assert_array_equal(read.reshape(chosen.shape), chosen)
        assert L.max() == nmax  # the top level (Q5_K's fifth bit) is in use, so its packing was exercised
    d, sc, L = kquants.q6_k_choice(blocks)
    chosen = (d[:, None] * sc).repeat(16, axis=1) * (L.astype(np.float32) - 32)
    np.testing.assert_array_equal(gguf.quants.dequantize(kquants.quantize(x, T.Q6_K), T.Q6_K).reshape(-1, 256),
                                  chosen)
    iq_blocks = x.reshape(-1, 32)
    d, L = kquants.iq4_nl_choice(iq_blocks)
    chosen = d.astype(np.float16).astype(np.float32)[:, None] * kquants.IQ4_NL_VALUES[L].astype(np.float32)
    read = gguf.quants.dequantize(kquants.quantize(x, T.IQ4_NL), T.IQ4_NL)
    np.testing.assert_array_equal(read.reshape(-1, 32), chosen)


def test_more_bits_quantize_gaussian_weights_better():
    """Relative RMSE on N(0, 1): Q6_K 0.018 < Q5_K 0.036 < Q4_K 0.071 < Q4_0 0.086, and IQ4_NL 0.076 beats
    Q4_0 at the same 4.5 bits per weight."""
    x = gaussian(64, 1024, seed=2)
    error = {qtype: relative_rmse(x, qtype) for qtype in TYPES}
    q4_0 = relative_rmse(x, T.Q4_0, gguf.quants.quantize)
    assert error[T.Q6_K] < error[T.Q5_K] < error[T.Q4_K] < q4_0
    assert error[T.IQ4_NL] <= q4_0
    assert 0.01 < error[T.Q6_K] < 0.025 and 0.06 < error[T.Q4_K] < 0.08  # near what ggml gets


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_degenerate_rows_stay_finite(qtype):
    n = 512
    rows = np.zeros((6, n), dtype=np.float32)
    rows[1] = 0.3  # constant
    rows[2] = -7.0
    rows[3] = gaussian(1, n, seed=3)[0] * np.float32(0.02)
    rows[3, 100] = 3.0e4  # one huge outlier, still inside fp16's range as every GGUF scale must be
    rows[4] = gaussian(1, n, seed=4)[0] * np.float32(1e-40)  # subnormal floats
    rows[5] = gaussian(1, n, seed=5)[0] * np.float32(1e-12)  # tiny: fp16 scales underflow
    y = gguf.quants.dequantize(kquants.quantize(rows, qtype), qtype)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[0], 0)
    np.testing.assert_allclose(y[1], 0.3, rtol=1e-2)
    np.testing.assert_allclose(y[2], -7.0, rtol=1e-2)
    assert abs(y[3, 100] - 3.0e4) < 0.02 * 3.0e4  # the outlier survives
    assert np.abs(y[4:]).max() < 1e-6


@pytest.mark.parametrize("qtype", [T.Q6_K, T.IQ4_NL], ids=lambda t: t.name)
def test_large_matrices_go_through_in_chunks(qtype):
    """More blocks than one chunk holds, with a last chunk of one block, give what smaller calls give."""
    block = GGML_QUANT_SIZES[qtype][0]
    x = gaussian(kquants.CHUNK_VALUES // block + 1, block, seed=6)
    whole = kquants.quantize(x, qtype)
    np.testing.assert_array_equal(whole[-1:], kquants.quantize(x[-1:], qtype))
    np.testing.assert_array_equal(whole[:2], kquants.quantize(x[:2], qtype))


@pytest.mark.parametrize("weights, qtype", [
    (np.zeros((2, 100), np.float32), T.Q4_K),  # 100 is not a multiple of 256
    (np.zeros((2, 48), np.float32), T.IQ4_NL),  # nor 48 of 32
    (np.zeros(256, np.float32), T.Q6_K),  # 1-D
    (np.zeros((2, 2, 256), np.float32), T.Q5_K),  # 3-D
    (np.zeros((2, 256), np.int32), T.Q4_K),  # not floats
    (np.zeros((2, 256), np.float32), T.Q4_0),  # a type the gguf package writes itself
    (np.full((2, 256), np.nan, np.float32), T.Q6_K),  # no meaning in any format
])
def test_wrong_input_is_a_value_error(weights, qtype):
    with pytest.raises(ValueError):
        kquants.quantize(weights, qtype)

"""FP8 e4m3 / FP4 e2m1 / E8M0 decoding against float64 decoders written from the formats'
definitions (bit fields), and quantise -> dequantise round trips within each format's precision."""

import numpy as np
import pytest
import torch

from kvcache.engine.checkpoint.quant import (dequant_fp4, dequant_fp8, e8m0_to_float, quantize_fp4, quantize_fp8,
                                             unpack_fp4)


def e4m3_ref(byte: int) -> float:
    """OCP FP8 E4M3 (fn): 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities, S.1111.111 = NaN."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def e2m1_ref(nib: int) -> float:
    """OCP FP4 E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa; e = 0 is subnormal (0 or 0.5)."""
    s, e, m = nib >> 3, (nib >> 1) & 0x3, nib & 0x1
    v = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -v if s else v


def test_every_e4m3_byte_decodes_as_defined():
    raw = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    got = raw.view(torch.float8_e4m3fn).to(torch.float64).numpy()
    want = np.array([e4m3_ref(b) for b in range(256)])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


def test_every_e2m1_nibble_and_packing_order():
    bytes_ = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(1, 256)
    got = unpack_fp4(bytes_).double().numpy()[0]
    want = np.array([[e2m1_ref(b & 0xF), e2m1_ref(b >> 4)] for b in range(256)]).reshape(-1)   # low nibble first
    assert np.array_equal(got, want)


def test_e8m0_is_a_power_of_two_exponent():
    raw = torch.tensor([0, 1, 126, 127, 128, 200, 254, 255], dtype=torch.uint8)
    got = e8m0_to_float(raw.view(torch.float8_e8m0fnu)).double().numpy()
    want = [2.0 ** (b - 127) for b in [0, 1, 126, 127, 128, 200, 254]]
    assert np.allclose(got[:-1], want, rtol=0) and np.isnan(got[-1])


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_fp8_block_dequant_matches_float64_reference(block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 96, generator=g) * torch.logspace(-3, 2, 96)        # blocks of very different range
    q, s = quantize_fp8(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert tuple(s.shape) == (-(-200 // block[0]), -(-96 // block[1]))
    qb, sb = q.view(torch.uint8).numpy(), s.view(torch.uint8).numpy()
    ref = np.array([[e4m3_ref(int(qb[i, j])) * 2.0 ** (int(sb[i // block[0], j // block[1]]) - 127)
                     for j in range(96)] for i in range(200)])
    got = dequant_fp8(q, s, block).double().numpy()
    assert np.array_equal(got, ref)                                          # exact: fp32 holds these products
    err = np.abs(got - w.double().numpy()) / np.maximum(np.abs(w.double().numpy()), 1e-30)
    assert np.median(err) < 0.04                                            # 3 mantissa bits


def test_fp4_expert_dequant_matches_float64_reference():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 128, generator=g)
    packed, s = quantize_fp4(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (16, 64) and tuple(s.shape) == (16, 4)
    pb, sb = packed.view(torch.uint8).numpy(), s.view(torch.uint8).numpy()
    ref = np.zeros((16, 128))
    for i in range(16):
        for j in range(128):
            nib = (int(pb[i, j // 2]) >> (4 * (j % 2))) & 0xF
            ref[i, j] = e2m1_ref(nib) * 2.0 ** (int(sb[i, j // 32]) - 127)
    got = dequant_fp4(packed, s).double().numpy()
    assert np.array_equal(got, ref)
    # nearest-value rounding: every value is within half a step of the format's grid at its scale
    scale = 2.0 ** (sb.astype(np.float64) - 127).repeat(32, 1)
    assert np.all(np.abs(got - w.double().numpy()) <= 1.0 * scale + 1e-12)


def test_bad_scale_shapes_name_the_problem():
    q, s = quantize_fp8(torch.randn(64, 64), (32, 32))
    with pytest.raises(ValueError, match="expected"):
        dequant_fp8(q, s[:1], (32, 32))
    p, s4 = quantize_fp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="one scale per 32"):
        dequant_fp4(p, s4[:, :1])

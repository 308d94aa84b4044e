"""Checkpoint number formats: FP8 e4m3 block-scaled linears and FP4 e2m1 packed experts.

    FP8 linear   weight [out, in] float8_e4m3fn,  weight.scale [ceil(out/b), ceil(in/b)] E8M0
                 w[i, j] = e4m3(weight[i, j]) * 2^(scale[i // b, j // b] - 127)
                 b = 128 (V4) or 32 (V4.1): `quantization_config.weight_block_size`
    FP4 expert   weight [out, in/2] int8, two e2m1 values per byte, low nibble = even column
                 weight.scale [out, in/32] E8M0, one power of two per 32 inputs (MXFP4)
                 e2m1 nibble: sign bit 3, magnitude index bits 0-2 -> {0, .5, 1, 1.5, 2, 3, 4, 6}

E8M0 is an exponent byte only (no sign, no mantissa): 2^(byte - 127); byte 255 is NaN.
Dequantisation runs in fp32 and one tensor at a time (the loader never holds two model copies).
`quantize_*` produce the same formats, with power-of-two scales chosen so the block's largest
magnitude fits (448 for e4m3, 6 for e2m1); `kvcache model init` writes demo checkpoints with them.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4_GROUP = 32


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (float8_e8m0fnu, or their raw uint8 bytes) -> fp32 powers of two."""
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale.to(torch.uint8)
    out = torch.exp2(raw.to(torch.float32) - 127.0)
    return torch.where(raw == 255, torch.full_like(out, float("nan")), out)


def _e8m0(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents.clamp(-127, 127) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return s[: shape[0], : shape[1]]


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8_e4m3fn [out, in] with E8M0 block scales -> fp32 [out, in]."""
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale has shape {tuple(scale.shape)}, expected {want} for a {rows}x{cols} weight "
                         f"in {block[0]}x{block[1]} blocks")
    return weight.to(torch.float32) * _expand_blocks(scale, (rows, cols), block)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (float8_e4m3fn weight, E8M0 block scales)."""
    rows, cols = w.shape
    br, bc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(br * block[0], bc * block[1], dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    amax = padded.view(br, block[0], bc, block[1]).abs().amax(dim=(1, 3))
    exp = torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / E4M3_MAX))
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
    scale = _e8m0(exp)
    q = (w.float() / _expand_blocks(scale, (rows, cols), block)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [out, in/2] -> fp32 e2m1 values [out, in] (unscaled)."""
    b = packed.view(torch.uint8).to(torch.int64)
    nib = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)           # low nibble first
    mag = E2M1_VALUES[nib & 0x7]
    return torch.where(nib & 0x8 != 0, -mag, mag)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [out, in/2] with per-32 E8M0 scales [out, in/32] -> fp32 [out, in]."""
    vals = unpack_fp4(packed)
    rows, cols = vals.shape
    if tuple(scale.shape) != (rows, -(-cols // FP4_GROUP)):
        raise ValueError(f"FP4 scale has shape {tuple(scale.shape)}, expected {(rows, -(-cols // FP4_GROUP))} "
                         f"for a {rows}x{cols} expert weight (one scale per {FP4_GROUP} inputs)")
    return vals * e8m0_to_float(scale).repeat_interleave(FP4_GROUP, 1)[:, :cols]


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] (in divisible by 32) -> (int8 [out, in/2] packed e2m1, E8M0 scales [out, in/32])."""
    rows, cols = w.shape
    if cols % FP4_GROUP:
        raise ValueError(f"FP4 experts need the input width to be a multiple of {FP4_GROUP}, got {cols}")
    g = w.float().view(rows, cols // FP4_GROUP, FP4_GROUP)
    amax = g.abs().amax(-1)
    exp = torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / E2M1_MAX))
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
    scale = _e8m0(exp)
    x = (g / e8m0_to_float(scale)[..., None]).view(rows, cols)
    idx = (x.abs()[..., None] - E2M1_VALUES).abs().argmin(-1)           # nearest magnitude
    nib = idx | torch.where(x < 0, 8, 0)
    nib = nib.view(rows, cols // 2, 2)
    packed = (nib[..., 0] | (nib[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale

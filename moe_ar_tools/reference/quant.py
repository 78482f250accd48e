"""The quantized outputs' rules, in float32 tensor arithmetic: NVFP4 (E2M1 values with E4M3 block
scales in the 128x4 swizzled layout; encode and decode) and FP8 E4M3 (per-token-group-128 or
per-tensor scales) (docs/operation.md)."""
from __future__ import annotations

import math

import torch

# The runtime's own output sizes: a reference or test imports them, never restates them.
from dispatch.op import FP8_GROUP, fp8_scale_shape, scale_out_bytes
from moe_ar_tools.reference.rounding import f32


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7
# Boundary between code c and c+1: (midpoint, does an exact tie go up?).
# Ties go to the even code: up exactly when c + 1 is even (c odd).
E2M1_BOUNDARIES = (
    (0.25, False),  # 0 | 0.5   -> tie to 0   (code 0)
    (0.75, True),   # 0.5 | 1   -> tie to 1   (code 2)
    (1.25, False),  # 1 | 1.5   -> tie to 1   (code 2)
    (1.75, True),   # 1.5 | 2   -> tie to 2   (code 4)
    (2.5, False),   # 2 | 3     -> tie to 2   (code 4)
    (3.5, True),    # 3 | 4     -> tie to 4   (code 6)
    (5.0, False),   # 4 | 6     -> tie to 4   (code 6); above 6 saturates at code 7
)
E4M3_MAX = 448.0
E4M3_NAN_BYTE = 0x7F  # the NaN the saturating convert writes, whatever the NaN's sign


def e2m1_nibbles(v: torch.Tensor) -> torch.Tensor:
    """float32 values -> E2M1 nibbles (uint8 0..15): RNE, saturating to 6, sign kept.

    The sign bit comes from v's sign bit: -0.0 and negatives that round to 0 give 0x8.
    """
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, tie_up in E2M1_BOUNDARIES:
        code += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=nibbles.device)
    n = nibbles.to(torch.int64)
    mag = table[n & 7]
    return torch.where((n & 8) != 0, -mag, mag)


def e4m3_satfinite_bytes(sf: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3 bytes as the GPU's saturating convert: RNE, saturating to +-448 (infinities
    too), every NaN to 0x7F (clamp, then torch's RNE convert; torch alone would keep a NaN's sign)."""
    b = sf.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(sf), torch.full_like(b, E4M3_NAN_BYTE), b)


def _canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """Every NaN as the positive one: a GPU's float32 arithmetic returns that NaN whatever NaN or
    invalid operation (0 * inf, 0 / 0) made it, where a CPU's may return a negative one."""
    return torch.where(torch.isnan(x), torch.full_like(x, math.nan), x)


def _roundup(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def swizzle_offsets(tokens: int, hidden: int, device="cpu") -> torch.Tensor:
    """int64 [tokens, hidden/16]: byte offset of scale (m, k) in the 128x4 layout."""
    num_k_tiles = (hidden + 63) // 64
    m = torch.arange(tokens, dtype=torch.int64, device=device)[:, None]
    k = torch.arange(hidden // 16, dtype=torch.int64, device=device)[None, :]
    return ((m // 128) * (num_k_tiles * 512) + (k // 4) * 512
            + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4))


def unswizzle(scale_bytes: torch.Tensor, tokens: int, hidden: int) -> torch.Tensor:
    """Decoder rule: reshape (rows/128, cols/4, 32, 4, 4), permute (0, 3, 2, 1, 4)."""
    rows, cols = _roundup(tokens, 128), _roundup(hidden // 16, 4)
    b = scale_bytes.reshape(-1)[: rows * cols]
    return (b.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
            .reshape(rows, cols)[:tokens, : hidden // 16])


def _gs_float(global_scale) -> float:
    return float(torch.as_tensor(global_scale).detach().to("cpu", torch.float32).reshape(-1)[0])


def _gs_like(amax: torch.Tensor, global_scale) -> torch.Tensor:
    """The global scale as a float32 tensor to combine with amax: a tensor on amax's device stays
    there (no read back to the host, so the soak's check never waits for the GPU); anything else
    becomes a full tensor of its float32 value. Either way every operation with it is tensor by
    tensor, so it rounds the same."""
    if isinstance(global_scale, torch.Tensor) and global_scale.device == amax.device:
        return global_scale.detach().reshape(-1)[:1].to(torch.float32).reshape((1,) * amax.dim())
    return torch.full_like(amax, _gs_float(global_scale))


def nvfp4_block_scales(x: torch.Tensor, global_scale):
    """Blocked float32 x [T, H/16, 16] -> (amax, sf, sf8 bytes, scale), each [T, H/16].

    docs/operation.md step by step, every operation a float32 tensor op (correctly rounded). For any global
    scale (0, negative, NaN, infinite: dispatch/API.md's table) the same arithmetic as written:
    the convert saturates both ways and writes NaN as 0x7F, and "sf8 != 0" compares the stored byte
    (0x80, -0, is not 0: its scale is 1 / (-0 / gs)); with gs >= +0 no byte 0x80 arises.
    """
    amax = x.abs().amax(-1)
    gs = _gs_like(amax, global_scale)
    sf = (gs * amax) / torch.full_like(amax, 6.0)
    sf8 = e4m3_satfinite_bytes(sf)
    sf8f = sf8.view(torch.float8_e4m3fn).to(torch.float32)
    t = sf8f / gs
    scale = torch.where(sf8 != 0, torch.ones_like(t) / t, torch.zeros_like(t))
    return amax, sf, sf8, scale


def nvfp4_blocks(norm_out: torch.Tensor, global_scale):
    """(quant [T, H/2] uint8, sf8 [T, H/16] uint8): the NVFP4 of norm_out (docs/operation.md) with the E4M3 block
    scale of each (token, 16-element block) before swizzling. global_scale: a float, or a [1]
    float32 tensor (on norm_out's device it is never read back to the host).
    Element 2i goes to the low nibble, 2i+1 to the high one.
    """
    T, H = norm_out.shape
    assert H % 16 == 0, H
    x = norm_out.to(torch.float32).reshape(T, H // 16, 16)
    _, _, sf8, scale = nvfp4_block_scales(x, global_scale)
    nibbles = e2m1_nibbles(_canonical_nan(x * scale[..., None])).reshape(T, H)  # a NaN product: nibble 0
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), sf8


def nvfp4_ref(norm_out: torch.Tensor, global_scale):
    """(quant [T, H/2] uint8, scale_bytes 1-D uint8 of scale_out_bytes(T, H)): nvfp4_blocks with
    the block scales in the 128x4 swizzled layout; padding bytes are 0.

    norm_out is the D-rounded norm output; global_scale a float or [1] tensor (fp32).
    """
    T, H = norm_out.shape
    quant, sf8 = nvfp4_blocks(norm_out, global_scale)
    scale_bytes = torch.zeros(scale_out_bytes(T, H), dtype=torch.uint8, device=norm_out.device)
    scale_bytes[swizzle_offsets(T, H, device=norm_out.device).reshape(-1)] = sf8.reshape(-1)
    return quant, scale_bytes


def nvfp4_dequant(quant: torch.Tensor, scale_bytes: torch.Tensor, global_scale, tokens: int, hidden: int):
    """float32 [T, H]: e2m1 value * float(sf8) / gs."""
    q = quant.reshape(tokens, hidden // 2)
    nib = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(tokens, hidden)
    vals = e2m1_decode(nib).reshape(tokens, hidden // 16, 16)
    sf = unswizzle(scale_bytes, tokens, hidden).contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    gs = torch.full_like(sf, _gs_float(global_scale))
    return (vals * (sf / gs)[..., None]).reshape(tokens, hidden)


# ---- FP8 outputs for Hopper consumers (docs/operation.md, the two FP8 sections) --------------

FP8_EPS = 1e-10


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(s)) for float32 s > 0, exactly (frexp, not a rounded log2)."""
    m, e = torch.frexp(s.to(torch.float32))
    e = torch.where(m == 0.5, e - 1, e)  # s is already a power of two
    return torch.ldexp(torch.ones_like(s, dtype=torch.float32), e)


def fp8_group_ref(norm_out: torch.Tensor, *, pow2_scales: bool = False, column_major: bool = False):
    """Per-token-group FP8 E4M3 of the dtype-rounded norm_out, vLLM/SGLang per_token_group_quant_fp8
    convention, every step in float32: amax = max(max|x| over 128 elements, 1e-10); s = amax / 448;
    s = 2^ceil(log2 s) if pow2_scales; q = e4m3(clamp(x / s, -448, 448)) with round-to-nearest-even.
    Returns (q [T, H] float8_e4m3fn, scales float32): [T, H/128] row-major, or column-major
    [H/128, roundup(T, 4)] (T padded to a multiple of 4 for TMA alignment; padding 0)."""
    T, H = norm_out.shape
    if H % FP8_GROUP:
        raise ValueError(f"hidden {H} is not a multiple of {FP8_GROUP}")
    x = norm_out.to(torch.float32).reshape(T, H // FP8_GROUP, FP8_GROUP)
    amax = torch.clamp(x.abs().amax(dim=-1), min=FP8_EPS)
    # A full tensor divisor, never a 0-dim one: torch turns division by a CPU scalar into a
    # multiplication by its rounded reciprocal on the GPU, which is not the rule's division.
    s = amax / torch.full_like(amax, E4M3_MAX)
    if pow2_scales:
        s = pow2_ceil(s)
    q = e4m3_satfinite_bytes(x / s[..., None]).view(torch.float8_e4m3fn).reshape(T, H)
    if not column_major:
        return q, s
    cols = torch.zeros(fp8_scale_shape(T, H, "column"), dtype=torch.float32, device=s.device)
    cols[:, :T] = s.t()
    return q, cols


def fp8_tensor_ref(norm_out: torch.Tensor, scale: float):
    """Per-tensor FP8 E4M3 with one static float32 scale: q = e4m3(clamp(x / scale, -448, 448)), a
    NaN quotient (a NaN scale, 0 / 0) as 0x7F. Any scale follows it (dispatch/API.md's table)."""
    x = norm_out.to(torch.float32)
    s = torch.full_like(x, f32(float(scale)))  # a full tensor divisor: see fp8_group_ref
    return e4m3_satfinite_bytes(x / s).view(torch.float8_e4m3fn)

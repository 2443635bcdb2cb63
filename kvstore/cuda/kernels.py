"""Triton kernels for the block codecs of ``kvstore.quant``, bit-exact with its CPU reference.

Imports triton at module level: load it only through ``kvstore.cuda.codecs``, which does so lazily.

Why integers: every step that can meet a subnormal float32 works on bit patterns, so results do
not depend on flush-to-zero (Triton links libdevice with ftz on) nor on the interpreter. Two float
operations remain, both on normal numbers only: the per-block ``amax / 6`` (or ``/ 448``) through
``div_rn`` (Triton's ``/`` is approximate), and E2M1 tie times an E4M3 scale (an exact product).

E2M1 without dividing: for every tie ``t`` of E2M1 and every scale ``s`` these formats produce,
``round(x / s) > t  <=>  |x| > t * s`` (``t * s`` is exact; tests/test_cuda_codecs.py checks it for
all E4M3 scales), so a code is the count of thresholds ``|x|`` passes. Codes are packed two per
byte, even element in the low nibble; E2M1 and E4M3 carry the sign of ``x`` (so -0.0 keeps it).
"""

from __future__ import annotations

import triton
import triton.language as tl

SRC_F32, SRC_BF16, SRC_F16 = 0, 1, 2  # input loaded as int32 bits, as int16 bits, as float16
DST_F32, DST_BF16, DST_F16 = 0, 1, 2  # output stored the same three ways


@triton.jit
def _load_bits(ptr, offs, mask, SRC: tl.constexpr):
    """float32 bit patterns of the input: bf16 widens by a shift, fp16 converts exactly."""
    if SRC == 0:
        bits = tl.load(ptr + offs, mask=mask, other=0)
    elif SRC == 1:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) << 16
    else:
        bits = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    return bits


@triton.jit
def _store_bits(ptr, offs, bits, mask, DST: tl.constexpr):
    """Store float32 bit patterns; to bf16 rounding to nearest even on the bits (FTZ-proof)."""
    if DST == 0:
        tl.store(ptr + offs, bits, mask=mask)
    elif DST == 1:
        tl.store(ptr + offs, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, bits.to(tl.float32, bitcast=True).to(tl.float16), mask=mask)


@triton.jit
def _rne_shift(m, sh):
    """``m >> sh`` rounded to nearest, ties to even (m >= 0, 1 <= sh <= 30)."""
    q = m >> sh
    rem = m - (q << sh)
    half = 1 << (sh - 1)
    return q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)


@triton.jit
def _e4m3_encode(ab):
    """float32 bits of a magnitude <= 448 -> E4M3 code (no sign), round to nearest even."""
    r = ab + 0x7FFFF + ((ab >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    m = (ab & 0x7FFFFF) | 0x800000  # below 2^-6: a multiple of 2^-9, i.e. m >> (141 - exponent)
    sub = _rne_shift(m, tl.minimum(tl.maximum(141 - (ab >> 23), 1), 30))
    return tl.where(ab >= 0x3C800000, normal, sub)


@triton.jit
def _e4m3_decode(c):
    """E4M3 code (sign ignored) -> float32 bits of its magnitude; 0x7F is NaN."""
    e = (c >> 3) & 15
    m = c & 7
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    bits = tl.where(e == 0, sub, ((e + 120) << 23) | (m << 20))
    return tl.where((c & 0x7F) == 0x7F, 0x7FC00000, bits)


@triton.jit
def _ldexp_exact(bits, e):
    """float32 bits of ``value * 2^e`` for a magnitude whose product is representable (zero, subnormal
    or normal); overflow gives +Inf. No rounding happens: shifted-out bits are zero."""
    ex = (bits >> 23) + e
    normal = bits + e * 8388608
    sub = ((bits & 0x7FFFFF) | 0x800000) >> tl.minimum(tl.maximum(1 - ex, 0), 31)
    out = tl.where(ex >= 1, normal, sub)
    out = tl.where(ex >= 255, 0x7F800000, out)
    return tl.where(bits == 0, 0, out)


@triton.jit
def _ue8m0_ceil(a, div):
    """Exponent e of 2^ceil(log2(a / div)) for normal float32 a and a normal quotient."""
    tb = tl.math.div_rn(a.to(tl.float32, bitcast=True), div).to(tl.int32, bitcast=True)
    return (tb >> 23) - 127 + ((tb & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _flag_nonfinite(flag_ptr, amax):
    bad = tl.max((amax >= 0x7F800000).to(tl.int32), axis=0)
    tl.store(flag_ptr, bad, mask=bad > 0)


@triton.jit
def fp4_quantize(x_ptr, codes_ptr, scales_ptr, flag_ptr, n_blocks,
                 BLOCK: tl.constexpr, E4M3: tl.constexpr, SRC: tl.constexpr, ROWS: tl.constexpr):
    """ROWS blocks of BLOCK elements -> packed E2M1 codes and one scale byte per block."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    bits = _load_bits(x_ptr, rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :], live[:, None], SRC)
    ab = bits & 0x7FFFFFFF
    amax = tl.max(ab, axis=1)
    _flag_nonfinite(flag_ptr, amax)
    if E4M3:  # scale = e4m3(clamp(max(amax, 6 * 2^-9) / 6, max=448))
        t = tl.math.div_rn(tl.maximum(amax, 0x3C400000).to(tl.float32, bitcast=True), 6.0)
        sc = _e4m3_encode(tl.minimum(t, 448.0).to(tl.int32, bitcast=True))
        s = _e4m3_decode(sc).to(tl.float32, bitcast=True)
        t0 = (s * 0.25).to(tl.int32, bitcast=True)
        t1 = (s * 0.75).to(tl.int32, bitcast=True)
        t2 = (s * 1.25).to(tl.int32, bitcast=True)
        t3 = (s * 1.75).to(tl.int32, bitcast=True)
        t4 = (s * 2.5).to(tl.int32, bitcast=True)
        t5 = (s * 3.5).to(tl.int32, bitcast=True)
        t6 = (s * 5.0).to(tl.int32, bitcast=True)
    else:  # scale = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), its exponent byte biased by 127
        e = _ue8m0_ceil(tl.maximum(amax, 0x01C00000), 6.0)
        sc = e + 127
        z = e * 0  # the ties 0.25 ... 5.0 as float32 bits, one per block
        t0 = _ldexp_exact(z + 0x3E800000, e)
        t1 = _ldexp_exact(z + 0x3F400000, e)
        t2 = _ldexp_exact(z + 0x3FA00000, e)
        t3 = _ldexp_exact(z + 0x3FE00000, e)
        t4 = _ldexp_exact(z + 0x40200000, e)
        t5 = _ldexp_exact(z + 0x40600000, e)
        t6 = _ldexp_exact(z + 0x40A00000, e)
    # odd ties (0.75, 1.75, 3.5) round up to the even code above them, the others down
    mag = ((ab > t0[:, None]).to(tl.int32) + (ab >= t1[:, None]).to(tl.int32)
           + (ab > t2[:, None]).to(tl.int32) + (ab >= t3[:, None]).to(tl.int32)
           + (ab > t4[:, None]).to(tl.int32) + (ab >= t5[:, None]).to(tl.int32)
           + (ab > t6[:, None]).to(tl.int32))
    codes = mag | (((bits >> 31) & 1) << 3)
    lo, hi = tl.split(tl.reshape(codes, (ROWS, BLOCK // 2, 2)))
    offs = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    tl.store(codes_ptr + offs, (lo | (hi << 4)).to(tl.uint8), mask=live[:, None])
    tl.store(scales_ptr + rows, sc.to(tl.uint8), mask=live)


@triton.jit
def fp4_dequantize(codes_ptr, scales_ptr, out_ptr, n_blocks,
                   BLOCK: tl.constexpr, E4M3: tl.constexpr, DST: tl.constexpr, ROWS: tl.constexpr):
    """Packed E2M1 codes and scale bytes -> values ``code * scale`` in the output dtype."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    offs = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    packed = tl.load(codes_ptr + offs, mask=live[:, None], other=0).to(tl.int32)
    sc = tl.load(scales_ptr + rows, mask=live, other=127).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 15, packed >> 4), (ROWS, BLOCK))
    m = codes & 7  # E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as float32 bits
    mag = tl.where(m < 2, m * 0x3F000000, (((m >> 1) + 126) << 23) | ((m & 1) << 22))
    if E4M3:  # a signed E4M3 scale: the product of two short mantissas is exact
        s = (_e4m3_decode(sc) | ((sc >> 7) << 31)).to(tl.float32, bitcast=True)
        bits = (mag.to(tl.float32, bitcast=True) * s[:, None]).to(tl.int32, bitcast=True)
    else:
        bits = _ldexp_exact(mag, sc[:, None] - 127)
    bits = bits ^ ((codes >> 3) << 31)
    out = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    _store_bits(out_ptr, out, bits, live[:, None], DST)


@triton.jit
def fp8_quantize(x_ptr, codes_ptr, scales_ptr, flag_ptr, n_blocks,
                 BLOCK: tl.constexpr, SRC: tl.constexpr, ROWS: tl.constexpr):
    """SWA: E4M3 codes of ``x / 2^e`` with ``2^e = ue8m0_ceil(max(amax, 1e-4) / 448)``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    bits = _load_bits(x_ptr, offs, live[:, None], SRC)
    ab = bits & 0x7FFFFFFF
    amax = tl.max(ab, axis=1)
    _flag_nonfinite(flag_ptr, amax)
    e1 = _ue8m0_ceil(tl.maximum(amax, 0x38D1B717), 448.0)  # 0x38D1B717: float32(1e-4)
    e = e1[:, None]
    ex = (ab >> 23) - e  # exponent of |x| / 2^e; at or below 0 it is below 2^-126 and encodes as 0
    v = tl.where(((ab >> 23) > 0) & (ex > 0), ab - e * 8388608, 0)
    codes = _e4m3_encode(tl.minimum(v, 0x43E00000)) | (((bits >> 31) & 1) << 7)
    tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=live[:, None])
    tl.store(scales_ptr + rows, (e1 + 127).to(tl.uint8), mask=live)


@triton.jit
def fp8_dequantize(codes_ptr, scales_ptr, out_ptr, n_blocks,
                   BLOCK: tl.constexpr, DST: tl.constexpr, ROWS: tl.constexpr):
    """SWA: E4M3 codes times ``2^(scale - 127)`` in the output dtype."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    c = tl.load(codes_ptr + offs, mask=live[:, None], other=0).to(tl.int32)
    sc = tl.load(scales_ptr + rows, mask=live, other=127).to(tl.int32)
    mag = _e4m3_decode(c)
    bits = tl.where(mag == 0x7FC00000, mag, _ldexp_exact(mag, sc[:, None] - 127))
    _store_bits(out_ptr, offs, bits ^ ((c >> 7) << 31), live[:, None], DST)

"""Triton kernels for the block codecs of ``kvstore.format.quant``, bit-exact with its CPU reference.

Imports triton at module level: load it only through ``kvstore.cuda.codecs``, which does so lazily.

Exact by construction, whatever the device: GPU float32 arithmetic here is IEEE (no flush to
zero: plain mul/add, ``div_rn`` for the two divisions per block), and the interpreter's numpy is
too, so every step rounds the same on both. Rounding to E2M1/E4M3 uses "magic" additions: adding
1.5 * 2^23 (or 2^(k+20)) leaves round-to-nearest-even of a scaled value in the low mantissa bits.

Dividing by the main format's E4M3 scale (not a power of two) is the one place that needs care;
``_divide_snapped`` and the float64 path say why they are exact, and tests/format/test_cuda_codecs.py
checks both premises (the first against every bf16 and fp16 value). Codes are packed two per
byte, even element in the low nibble; E2M1 and E4M3 carry the sign of ``x`` (so -0.0 keeps it).
"""

from __future__ import annotations

import triton
import triton.language as tl

SRC_F32, SRC_BF16, SRC_F16 = 0, 1, 2  # input loaded as int32 bits, as int16 bits, as float16
DST_F32, DST_BF16, DST_F16 = 0, 1, 2  # output stored the same three ways


@triton.jit
def _load_pairs(ptr, pairs, mask, SRC: tl.constexpr):
    """float32 values of elements 2j and 2j+1 for every pair index j. 16-bit inputs load as one int32
    per pair (even element in the low half, as the codes pack): no shuffles between threads."""
    if SRC == 0:
        lo = tl.load(ptr + 2 * pairs, mask=mask, other=0).to(tl.float32, bitcast=True)
        hi = tl.load(ptr + 2 * pairs + 1, mask=mask, other=0).to(tl.float32, bitcast=True)
    else:
        w = tl.load(ptr + pairs, mask=mask, other=0)
        if SRC == 1:  # bf16 widens to float32 by a shift
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
        else:
            lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _to_bf16_bits(bits, EXACT: tl.constexpr):
    """float32 bits -> bf16 bits in the low 16 bits; rounds to nearest even unless EXACT says the
    value is representable (then truncation is the same and cheaper)."""
    if not EXACT:
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16) & 0xFFFF


@triton.jit
def _store_pairs(ptr, pairs, lo, hi, mask, DST: tl.constexpr, EXACT: tl.constexpr):
    """Store float32 values of elements 2j and 2j+1; 16-bit outputs as one int32 per pair."""
    lob = lo.to(tl.int32, bitcast=True)
    hib = hi.to(tl.int32, bitcast=True)
    if DST == 0:
        tl.store(ptr + 2 * pairs, lob, mask=mask)
        tl.store(ptr + 2 * pairs + 1, hib, mask=mask)
    elif DST == 1:
        tl.store(ptr + pairs, _to_bf16_bits(lob, EXACT) | (_to_bf16_bits(hib, EXACT) << 16), mask=mask)
    else:
        lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        tl.store(ptr + pairs, lo16 | (hi16 << 16), mask=mask)


@triton.jit
def _e4m3_decode(c):
    """E4M3 code (sign ignored) -> float32 bits of its magnitude; 0x7F is NaN."""
    e = (c >> 3) & 15
    m = c & 7
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    bits = tl.where(e == 0, sub, ((e + 120) << 23) | (m << 20))
    return tl.where((c & 0x7F) == 0x7F, 0x7FC00000, bits)


@triton.jit
def _ue8m0_ceil(a, div):
    """Exponent e of 2^ceil(log2(a / div)) for normal float32 a and a normal quotient."""
    tb = tl.math.div_rn(a.to(tl.float32, bitcast=True), div).to(tl.int32, bitcast=True)
    return (tb >> 23) - 127 + ((tb & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _flag_nonfinite(flag_ptr, amax):
    """One flag for the program. (Per-row masked stores instead cost a predicated store per element:
    measured 25% slower on an H200.)"""
    bad = tl.max((amax >= 0x7F800000).to(tl.int32), axis=0)
    tl.store(flag_ptr, bad, mask=bad > 0)


@triton.jit
def _row_amax(lo, hi):
    """Per-block max of |x| as float32 bits (integer order is value order; NaN/Inf sort above)."""
    return tl.max(tl.maximum(lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF, hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF),
                  axis=1)


@triton.jit
def _e2m1_magnitude(y):
    """E2M1 code (0-7) of y >= 0, saturating at 6, ties to even. With k = round-to-even integer:
    code = min(k(2y), k(y) + 2, k(y/2) + 4, 7), each k taken in the low bits of 1.5 * 2^23 + ..."""
    m = 12582912.0
    y = tl.minimum(y, 6.0)
    k0 = (y * 2.0 + m).to(tl.int32, bitcast=True)
    k1 = (y + (m + 2.0)).to(tl.int32, bitcast=True)
    k2 = (y * 0.5 + (m + 4.0)).to(tl.int32, bitcast=True)
    return tl.minimum(tl.minimum(k0, k1), k2) & 7


@triton.jit
def _e4m3_round(y):
    """(E4M3 code, its value) of 0 <= y <= 448, ties to even. y + 2^(k+20), for y's binade 2^k
    (k >= -6, the subnormal step), holds round(y / 2^(k-3)) in its low bits; each binade adds 8."""
    big = tl.maximum(y.to(tl.int32, bitcast=True) & 0x7F800000, 0x3C800000) + (20 << 23)
    summed = y + big.to(tl.float32, bitcast=True)
    code = summed.to(tl.int32, bitcast=True) - big + ((big >> 23) - 141) * 8
    return code, summed - big.to(tl.float32, bitcast=True)


@triton.jit
def _divide_snapped(a, r, s):
    """float32(a / s) as far as E2M1 rounding can tell, for 16-bit inputs: a * (1 / s) is off by an
    ulp at most, which only matters when a / s is exactly a quarter (every E2M1 tie is one); those
    are recognised by multiplying back (exact: a quarter below 8 times s has <= 9 bits).
    Checked against every bf16 and fp16 value and every E4M3 scale (tests/format/test_cuda_codecs.py)."""
    y = a * r
    quarter = ((y * 4.0 + 12582912.0) - 12582912.0) * 0.25
    return tl.where(quarter * s == a, quarter, y)


@triton.jit
def fp4_quantize(x_ptr, codes_ptr, scales_ptr, flag_ptr, n_blocks, BLOCK: tl.constexpr, E4M3: tl.constexpr,
                 SRC: tl.constexpr, ROWS: tl.constexpr, DIV64: tl.constexpr):
    """ROWS blocks of BLOCK elements -> packed E2M1 codes and one scale byte per block."""
    HALF: tl.constexpr = BLOCK // 2
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    pairs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    lo, hi = _load_pairs(x_ptr, pairs, live[:, None], SRC)
    amax = _row_amax(lo, hi)
    _flag_nonfinite(flag_ptr, amax)
    if E4M3:  # scale = e4m3(clamp(max(amax, 6 * 2^-9) / 6, max=448)); y = x / scale, exactly
        t = tl.math.div_rn(tl.maximum(amax, 0x3C400000).to(tl.float32, bitcast=True), 6.0)
        sc, s = _e4m3_round(tl.minimum(t, 448.0))
        if DIV64 or SRC == 0:
            # float64 x * (1 / s) rounds to float32 as x / s does: x / s is never within 2^-29 of
            # a float32 rounding boundary it does not sit on (s has 4 significant bits)
            inv = (1.0 / s.to(tl.float64))[:, None]
            ylo = (tl.abs(lo).to(tl.float64) * inv).to(tl.float32)
            yhi = (tl.abs(hi).to(tl.float64) * inv).to(tl.float32)
        else:
            r = tl.math.div_rn(s * 0.0 + 1.0, s)[:, None]
            ylo = _divide_snapped(tl.abs(lo), r, s[:, None])
            yhi = _divide_snapped(tl.abs(hi), r, s[:, None])
    else:  # scale = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)): dividing by it is an exact product
        e = _ue8m0_ceil(tl.maximum(amax, 0x01C00000), 6.0)
        sc = e + 127
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]
        ylo = tl.abs(lo) * inv
        yhi = tl.abs(hi) * inv
    lob = lo.to(tl.int32, bitcast=True)
    hib = hi.to(tl.int32, bitcast=True)
    packed = (_e2m1_magnitude(ylo) | ((lob >> 28) & 8) | (_e2m1_magnitude(yhi) << 4) | ((hib >> 24) & 0x80))
    tl.store(codes_ptr + pairs, packed.to(tl.uint8), mask=live[:, None])
    tl.store(scales_ptr + rows, sc.to(tl.uint8), mask=live)


@triton.jit
def _e2m1_values(nibble, s):
    """E2M1 code (sign in bit 3) times s, exactly. (m << 22) + 0x3F000000 is the float32 of every
    magnitude m >= 2 (and 0.5, 0.75 for m = 0, 1, which min(f, 2f - 1) mends)."""
    f = (((nibble & 7) << 22) + 0x3F000000).to(tl.float32, bitcast=True)
    v = tl.minimum(f, f * 2.0 - 1.0) * s
    return (v.to(tl.int32, bitcast=True) ^ ((nibble >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def fp4_dequantize(codes_ptr, scales_ptr, out_ptr, n_blocks,
                   BLOCK: tl.constexpr, E4M3: tl.constexpr, DST: tl.constexpr, ROWS: tl.constexpr):
    """Packed E2M1 codes and scale bytes -> values ``code * scale`` in the output dtype."""
    HALF: tl.constexpr = BLOCK // 2
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    pairs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    packed = tl.load(codes_ptr + pairs, mask=live[:, None], other=0).to(tl.int32)
    sc = tl.load(scales_ptr + rows, mask=live, other=127).to(tl.int32)
    if E4M3:  # a signed E4M3 scale (short mantissas: every product is exact)
        s = (_e4m3_decode(sc) | ((sc >> 7) << 31)).to(tl.float32, bitcast=True)
    else:
        s = (sc << 23).to(tl.float32, bitcast=True)
    lo = _e2m1_values(packed & 15, s[:, None])
    hi = _e2m1_values(packed >> 4, s[:, None])
    _store_pairs(out_ptr, pairs, lo, hi, live[:, None], DST, True)


@triton.jit
def fp8_quantize(x_ptr, codes_ptr, scales_ptr, flag_ptr, n_blocks,
                 BLOCK: tl.constexpr, SRC: tl.constexpr, ROWS: tl.constexpr):
    """SWA: E4M3 codes of ``x / 2^e`` with ``2^e = ue8m0_ceil(max(amax, 1e-4) / 448)``."""
    HALF: tl.constexpr = BLOCK // 2
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    pairs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    lo, hi = _load_pairs(x_ptr, pairs, live[:, None], SRC)
    amax = _row_amax(lo, hi)
    _flag_nonfinite(flag_ptr, amax)
    e = _ue8m0_ceil(tl.maximum(amax, 0x38D1B717), 448.0)  # 0x38D1B717: float32(1e-4)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]
    clo, _ = _e4m3_round(tl.minimum(tl.abs(lo) * inv, 448.0))
    chi, _ = _e4m3_round(tl.minimum(tl.abs(hi) * inv, 448.0))
    clo = clo | ((lo.to(tl.int32, bitcast=True) >> 24) & 0x80)
    chi = chi | ((hi.to(tl.int32, bitcast=True) >> 24) & 0x80)
    tl.store(codes_ptr + pairs, (clo | (chi << 8)).to(tl.int16), mask=live[:, None])  # two codes per int16
    tl.store(scales_ptr + rows, (e + 127).to(tl.uint8), mask=live)


@triton.jit
def _e4m3_values(c, s):
    """E4M3 codes (with sign) times s: the magnitude read as float16 bits is value * 2^-8, exactly."""
    mag = ((c & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    bits = tl.where((c & 0x7F) == 0x7F, 0x7FC00000, (mag * s).to(tl.int32, bitcast=True))
    return (bits ^ ((c >> 7) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def fp8_dequantize(codes_ptr, scales_ptr, out_ptr, n_blocks,
                   BLOCK: tl.constexpr, DST: tl.constexpr, ROWS: tl.constexpr):
    """SWA: E4M3 codes times ``2^(scale - 127)`` in the output dtype."""
    HALF: tl.constexpr = BLOCK // 2
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_blocks
    pairs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    w = tl.load(codes_ptr + pairs, mask=live[:, None], other=0).to(tl.int32)  # two codes per int16
    clo = w & 0xFF
    chi = (w >> 8) & 0xFF
    sc = tl.load(scales_ptr + rows, mask=live, other=127).to(tl.int32)
    # 2^(scale - 127 + 8) in two exact factors: each is a normal float32 for every scale byte 1-254
    s1 = (tl.minimum(sc + 8, 254) << 23).to(tl.float32, bitcast=True)[:, None]
    s2 = ((tl.maximum(sc + 8, 254) - 127) << 23).to(tl.float32, bitcast=True)[:, None]
    lo = _e4m3_values(clo, s1) * s2
    hi = _e4m3_values(chi, s1) * s2
    _store_pairs(out_ptr, pairs, lo, hi, live[:, None], DST, False)

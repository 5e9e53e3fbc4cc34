"""The INT4 packed-pairs PTX (`nanoserve.quant._pairs_asm`) run by a small PTX interpreter written here in numpy, so
its arithmetic is checked on the CPU: the GPU runs that string, the Triton interpreter cannot. With small integer
activations every product and sum is exact in bf16 and fp16, so the result must equal the exact dot product bit
for bit; with random activations it must stay within the bf16 rounding bound."""
from __future__ import annotations

import re

import numpy as np
import pytest

from nanoserve.quant import F16_PAIR_ASM, INT8_PAIRS_ASM, PAIRS_ASM, PAIRS_ASM_SHIFT, X_SCALE, _pairs_asm, neg_pair

M32 = np.uint64(0xFFFFFFFF)


def round_half(v: np.ndarray, bf16: bool) -> np.ndarray:
    "float64 -> the nearest bf16 / fp16 value (round to nearest even), as float64."
    if not bf16: return v.astype(np.float16).astype(np.float64)
    m, e = np.frexp(v)                                   # v = m 2^e, 0.5 <= |m| < 1: 8 significant bits for bf16
    return np.ldexp(np.round(m * 256) / 256, e)


def half_bits(v: np.ndarray, bf16: bool) -> np.ndarray:
    "Exactly representable float64 values -> their 16-bit patterns (uint64)."
    if bf16: return (v.astype(np.float32).view(np.uint32).astype(np.uint64) >> np.uint64(16))
    return v.astype(np.float16).view(np.uint16).astype(np.uint64)


def half_value(bits: np.ndarray, bf16: bool) -> np.ndarray:
    if bf16: return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def f32(bits: np.ndarray) -> np.ndarray: return bits.astype(np.uint32).view(np.float32)


def run_ptx(asm: str, inputs: list[np.ndarray]) -> np.ndarray:
    "Execute the instruction subset `_pairs_asm` uses on uint32 arrays; $0 (an f32) comes back as float32."
    regs: dict[str, np.ndarray] = {f"${i + 1}": np.asarray(v, dtype=np.int64).astype(np.uint64) & M32
                                   for i, v in enumerate(inputs)}
    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if re.fullmatch(r"0f[0-9a-fA-F]{8}", tok): return np.uint64(int(tok[2:], 16))     # a float's bits
        return np.uint64(int(tok, 0)) if re.fullmatch(r"(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]
    for line in asm.splitlines():
        line = line.strip()
        if not line or line in "{}" or line.startswith(".reg"): continue
        op, rest = line.rstrip(";").split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):                        # unpack into two 16-bit registers
            lo, hi, src = re.fullmatch(r"\{(\w+),\s*(\w+)\},\s*(\S+)", rest).groups()
            regs[lo], regs[hi] = val(src) & np.uint64(0xFFFF), val(src) >> np.uint64(16)
            continue
        d, *a = [t.strip() for t in rest.split(",")]
        if op == "mov.b32": r = val(a[0])
        elif op == "shr.u32": r = val(a[0]) >> val(a[1])
        elif op == "shl.b32": r = (val(a[0]) << val(a[1])) & M32
        elif op == "and.b32": r = val(a[0]) & val(a[1])
        elif op == "xor.b32": r = val(a[0]) ^ val(a[1])
        elif op == "prmt.b32":                       # byte i of the result: byte (selector nibble i) of {b, a}
            src, sel = val(a[0]) | (val(a[1]) << np.uint64(32)), int(a[2], 0)
            r = np.uint64(0) * src
            for i in range(4):
                r = r | (((src >> np.uint64(8 * (sel >> 4 * i & 7))) & np.uint64(0xFF)) << np.uint64(8 * i))
        elif op == "mul.rn.f32":
            r = (f32(val(a[0])) * f32(val(a[1]))).astype(np.float32).view(np.uint32).astype(np.uint64)
        elif op == "cvt.rn.f16x2.f32":               # d = f16(a) in the upper half, f16(b) in the lower
            hi, lo = (f32(val(t)).astype(np.float16).view(np.uint16).astype(np.uint64) for t in a)
            r = lo | (hi << np.uint64(16))
        elif op == "lop3.b32":                       # bit i of the result: bit (a b c) of the lookup table
            x, y, z, lut = val(a[0]), val(a[1]), val(a[2]), int(a[3], 0)
            r = np.uint64(0) * x
            for i in range(8):
                if lut >> i & 1:
                    r = r | ((x if i & 4 else ~x & M32) & (y if i & 2 else ~y & M32) & (z if i & 1 else ~z & M32))
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2", "add.rn.f16x2"):
            bf = op == "fma.rn.bf16x2"
            lanes = []
            for sh in (np.uint64(0), np.uint64(16)):
                v = [half_value((val(t) >> sh) & np.uint64(0xFFFF), bf) for t in a]
                exact = v[0] + v[1] if op.startswith("add") else v[0] * v[1] + v[2]
                lanes.append(half_bits(round_half(exact, bf), bf))          # one rounding of the exact result
            r = lanes[0] | (lanes[1] << np.uint64(16))
        elif op in ("cvt.f32.bf16", "cvt.f32.f16"):
            r = half_value(val(a[0]), op == "cvt.f32.bf16").astype(np.float32).view(np.uint32).astype(np.uint64)
        elif op == "add.f32":
            r = (f32(val(a[0])) + f32(val(a[1]))).astype(np.float32).view(np.uint32).astype(np.uint64)
        else: raise NotImplementedError(op)
        regs[d] = r
    return f32(regs["$0"])


def operands(x: np.ndarray, words: np.ndarray, z: np.ndarray, bf16: bool):
    "x [n, 8] exactly representable, words [n] uint32 (nibble m = input m), z [n] -> the asm's six inputs."
    xb = half_bits(x, bf16)
    pairs = [xb[:, k] | (xb[:, k + 4] << np.uint64(16)) for k in range(4)]   # pair k: inputs k and k + 4
    neg = half_bits(-(2.0 ** (7 if bf16 else 10) + z.astype(np.float64)), bf16)
    return [words, *pairs, neg | (neg << np.uint64(16))]


def nibbles(words: np.ndarray) -> np.ndarray:
    return np.stack([(words >> np.uint64(4 * m)) & np.uint64(15) for m in range(8)], 1).astype(np.float64)  # [n, 8]


@pytest.mark.parametrize("asm,bf16", [(PAIRS_ASM, True), (PAIRS_ASM_SHIFT, True), (_pairs_asm(False), False)])
def test_pairs_ptx_is_the_exact_dot_on_small_integers(asm, bf16):
    rng = np.random.default_rng(0)
    n = 4096
    words = rng.integers(0, 2 ** 32, n, dtype=np.uint64)
    x = rng.integers(-2, 3, (n, 8)).astype(np.float64)                 # every partial sum is an integer <= 240
    z = rng.integers(0, 16, n)
    out = run_ptx(asm, operands(x, words, z, bf16))
    np.testing.assert_array_equal(out, ((nibbles(words) - z[:, None]) * x).sum(1))
    zero = run_ptx(asm, operands(x, words, np.zeros(n, int), bf16))      # z = 0 is `neg_pair`: the sum of q x
    np.testing.assert_array_equal(zero, (nibbles(words) * x).sum(1))
    neg = operands(x, words, np.zeros(n, int), bf16)[-1].astype(np.int64)
    assert (np.where(neg >= 2 ** 31, neg - 2 ** 32, neg) == neg_pair(bf16)).all()


def test_pairs_ptx_rounding_stays_within_bf16s_bound():
    "Random bf16 activations: the products and four-term sums round to bf16 (8 bits), nothing worse."
    rng = np.random.default_rng(1)
    n = 4096
    words = rng.integers(0, 2 ** 32, n, dtype=np.uint64)
    x = round_half(rng.standard_normal((n, 8)) * 3, True)
    z = rng.integers(0, 16, n)
    terms = (nibbles(words) - z[:, None]) * x
    for asm in (PAIRS_ASM, PAIRS_ASM_SHIFT):
        err = np.abs(run_ptx(asm, operands(x, words, z, True)) - terms.sum(1))
        assert (err <= 2.0 ** -7 * np.abs(terms).sum(1) + 1e-30).all()
        assert err.max() > 0                                            # the roundings are there
    a, b = (run_ptx(asm, operands(x, words, z, True)) for asm in (PAIRS_ASM, PAIRS_ASM_SHIFT))
    np.testing.assert_array_equal(a, b)                                 # cvt or shift: the same lanes


def test_int8_pairs_ptx_is_the_exact_dot():
    """INT8 in fp16 pairs: the activation pairs (`F16_PAIR_ASM`: bf16 bits -> fp16 of x X_SCALE) and the bytes of
    two words (`INT8_PAIRS_ASM`): bit-exact on small integer activations, whose scaled products and sums are exact
    in fp16; within fp16's rounding on random ones."""
    rng = np.random.default_rng(2)
    n = 4096
    wa, wb = (rng.integers(0, 2 ** 32, n, dtype=np.uint64) for _ in range(2))
    q = np.stack([((w >> np.uint64(8 * b)) & np.uint64(0xFF)).astype(np.int64) for w in (wa, wb) for b in range(4)], 1)
    q = np.where(q >= 128, q - 256, q).astype(np.float64)                 # [n, 8] signed bytes, input order
    for x, exact in ((rng.integers(-4, 5, (n, 8)).astype(np.float64), True),
                     (round_half(rng.standard_normal((n, 8)) * 3, True), False)):
        bits = half_bits(x, True)
        pairs = [run_ptx(F16_PAIR_ASM.value, [bits[:, 2 * i] | (bits[:, 2 * i + 1] << np.uint64(16))])
                 .view(np.uint32).astype(np.uint64) for i in range(4)]
        lanes = np.stack([half_value((p >> np.uint64(s)) & np.uint64(0xFFFF), False) for p in pairs
                          for s in (0, 16)], 1)
        np.testing.assert_array_equal(lanes, round_half(x * X_SCALE, False))  # fp16 of x X_SCALE (exact if integer)
        out = run_ptx(INT8_PAIRS_ASM.value, [wa, wb, *pairs]).astype(np.float64) / X_SCALE
        terms = q * lanes / X_SCALE
        if exact: np.testing.assert_array_equal(out, terms.sum(1))
        else: assert (np.abs(out - terms.sum(1)) <= 2.0 ** -9 * np.abs(terms).sum(1) + 1e-30).all()

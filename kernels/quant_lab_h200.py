"""Why the one-row quantized GEMV runs far below the copy bandwidth, tested one hypothesis at a time.

Run on the device machine from the repo root:
    PYTHONPATH=. python kernels/quant_lab_h200.py --out $OUT [--parts int4,int8,read,int4g,int8b,abl,sz,half]
Writes quant_lab_h200.json (run metadata inside) after every part.

The 7B projections at one row, timed by `graph_bench` (CUDA graphs of back-to-back calls over weight copies that
defeat L2), each kernel checked against `quant_matmul_ref` first (its error recorded with its time; a kernel more
than 2% off fails the run, but for the ablations, wrong by design). The package's GEMV as shipped (`quant_matmul`,
its tuned table) is the control; the lab kernels below, forks that live only here, change one thing at a time:

- int4: `lab_int4_kernel`, INT4 words of 8 nibbles (one group per iteration) with switches
  TRICK (a nibble becomes the float 1 + q/16 by one shift and one mask-or: no subtract per weight; the zero
  point and the 1 come back once per word), PREFETCH (the next group's words are loaded before this group's
  arithmetic: the loop carries them), LATE (under PDL, the next kernel is let launch after the main loop instead
  of at the start: early launch parks the next kernel's programs on the SMs while this one still has waves to
  run), SCALES_T (scales and zeros stored [K / G, N]: one coalesced load per group instead of one per row);
- int8: `lab_int8_kernel`, the shipped one-row INT8 loop with PREFETCH and LATE, then a block sweep;
- read: `lab_read_kernel` reads the INT4 weights as int32 tiles with row runs of 64 to 1024 bytes (no arithmetic):
  the copy speed a tile shape allows;
- int4g: `lab_int4g_kernel`, GPT groups per load (row runs of GPT x 64 bytes), swept; int8b: INT8 with row runs of
  512 and 1024 bytes, swept;
- abl: the best int4g configuration per projection with each ablation of `lab_int4g_kernel` (ABL): where the
  INT4 GEMV's time goes, against the read speed of `read`;
- half: `lab_int4h_kernel`, two weights an instruction (packed half-precision arithmetic in inline PTX), against
  the shipped words path (the package's table, PDL on).
`--smoke`: every part on one tiny layer, a candidate or two each, on the CPU under the interpreter (no PDL; the
packed pairs' PTX emulated by the package's stand-in).
"""
import sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (best_trial, checked, device_or_skip, exit_if_failed, graph_bench, is_smoke, layer_shapes, max_rel_err,
                 operand_copies, parser, run_parts, saver, tensor_bytes, trial_row)

import torch
import triton
import triton.language as tl

from nanoserve.quant import (_pairs_asm, _pairs_emulated, neg_pair, quant_matmul,
                             quant_matmul_ref, quant_tables, quantize_int4, quantize_int8)
from nanoserve.runtime import finish_split, launch_options, pdl_launch_next, pdl_wait, split_counters, split_tiles

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # the CPU under --smoke (lab hides GPUs)
TINY = [("down_proj", 256, 1024, False)]                                 # --smoke's layer


@triton.jit
def _words_program(w_ptr, K, groups_per_split, stride_wn, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    "This program's channels, word columns, group range and word pointers ([BLOCK_N, GROUP / 8], group 0)."
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, GROUP // 8)
    g_begin = tl.program_id(1) * groups_per_split
    g_end = tl.minimum(g_begin + groups_per_split, K // GROUP)
    return offs_n, j, g_begin, g_end, w_ptr + offs_n[:, None] * stride_wn + j[None, :]


@triton.jit
def _trick_dot(words, xk, BLOCK_N: tl.constexpr, NW: tl.constexpr):
    """Words [BLOCK_N, NW] of 8 nibbles against the inputs at `xk + m`: (sum over each word of (1 + q / 16) x,
    the sum of each word's 8 inputs [NW]). A nibble becomes the float 1 + q / 16 by one shift and one mask-or."""
    acc = tl.full([BLOCK_N, NW], 0.0, tl.float32)
    xs = tl.full([NW], 0.0, tl.float32)
    for m in tl.static_range(8):
        if m <= 4:
            f = ((words << (19 - 4 * m)) & 0x00780000) | 0x3F800000
        else:
            f = ((words >> (4 * m - 19)) & 0x00780000) | 0x3F800000
        xm = tl.load(xk + m).to(tl.float32)
        acc += f.to(tl.float32, bitcast=True) * xm[None, :]
        xs += xm
    return acc, xs


@triton.jit
def lab_int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, N, K, groups_per_split,
                    stride_wn, stride_sn, stride_sg, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    GROUP: tl.constexpr, SPLIT: tl.constexpr, TRICK: tl.constexpr, PREFETCH: tl.constexpr,
                    PDL: tl.constexpr, LATE: tl.constexpr, SZ2D: tl.constexpr = False):
    if not LATE: pdl_launch_next(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NW: tl.constexpr = GROUP // 8
    offs_n, j, g_begin, g_end, wp = _words_program(w_ptr, K, groups_per_split, stride_wn, BLOCK_N, GROUP)
    words = tl.load(wp + g_begin * NW)                                        # weights only before the wait
    pdl_wait(PDL)
    total = tl.full([BLOCK_N, NW], 0.0, tl.float32)
    for g in range(g_begin, g_end):
        if PREFETCH:
            nxt = tl.load(wp + tl.minimum(g + 1, g_end - 1) * NW)            # the next group's words, in flight now
        xk = x_ptr + g * GROUP + 8 * j                                        # nibble m of word j is input 8 j + m
        acc = tl.full([BLOCK_N, NW], 0.0, tl.float32)
        if TRICK and SZ2D:                    # scales and zeros loaded straight into the words' layout (no convert)
            sp = offs_n[:, None] * stride_sn + g * stride_sg + 0 * j[None, :]                     # [BLOCK_N, NW]
            s2 = tl.load(s_ptr + sp)
            z2 = tl.load(z_ptr + sp).to(tl.float32)
            acc, xs = _trick_dot(words, xk, BLOCK_N, NW)
            total += acc * (16.0 * s2) - (s2 * (16.0 + z2)) * xs[None, :]
        elif TRICK:                                                           # f = 1 + q / 16, exactly
            s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg)
            z = tl.load(z_ptr + offs_n * stride_sn + g * stride_sg).to(tl.float32)
            acc, xs = _trick_dot(words, xk, BLOCK_N, NW)
            # sum (q - z) x s = s (16 sum f x - (16 + z) sum x)
            total += acc * (16.0 * s)[:, None] - (s * (16.0 + z))[:, None] * xs[None, :]
        else:
            s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg)
            zc = tl.load(z_ptr + offs_n * stride_sn + g * stride_sg).to(tl.float32) + 8388608.0   # 2^23 + z
            for m in tl.static_range(8):
                q = ((words >> (4 * m)) & 15) | 0x4B000000
                acc += (q.to(tl.float32, bitcast=True) - zc[:, None]) * tl.load(xk + m).to(tl.float32)[None, :]
            total += acc * s[:, None]
        if PREFETCH:
            words = nxt
        else:
            words = tl.load(wp + tl.minimum(g + 1, g_end - 1) * NW)
    if LATE: pdl_launch_next(PDL)
    acc = tl.sum(total, 1)[None, :]                                           # [1, BLOCK_N]
    finish_split(acc, bias_ptr, out_ptr, part_ptr, counter_ptr, tl.arange(0, 1), offs_n, 1, N, N, pid_n, pid_k,
                 tl.num_programs(1), HAS_BIAS, SPLIT)


@triton.jit
def lab_int4g_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, N, K, chunks_per_split,
                     stride_wn, stride_sn, stride_sg, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUP: tl.constexpr, GPT: tl.constexpr, SPLIT: tl.constexpr, TRICK: tl.constexpr,
                     PDL: tl.constexpr, LATE: tl.constexpr, ABL: tl.constexpr = 0, SZ2D: tl.constexpr = False):
    """`lab_int4_kernel` with GPT groups per iteration: each row's words of GPT groups (GPT x 64 bytes) in one load.
    ABL (ablations, wrong results, with TRICK): 1 the word itself as the float (no integer work per weight), 2 the
    activations loaded once before the loop (no loads per group), 3 both, 4 integer work only (the floats xor-ed
    into an integer tile, no multiply-add)."""
    if not LATE: pdl_launch_next(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NW: tl.constexpr = GROUP // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gi = tl.arange(0, GPT)
    j = tl.arange(0, NW)
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, K // (GROUP * GPT))
    wp = w_ptr + offs_n[:, None, None] * stride_wn + gi[None, :, None] * NW + j[None, None, :]   # [BLOCK_N, GPT, NW]
    words = tl.load(wp + c_begin * GPT * NW)                                  # weights only before the wait
    pdl_wait(PDL)
    total = tl.full([BLOCK_N, GPT, NW], 0.0, tl.float32)
    x0 = tl.load(x_ptr + gi[:, None] * GROUP + 8 * j[None, :]).to(tl.float32)
    for c in range(c_begin, c_end):
        g = c * GPT + gi                                                      # [GPT] group ids
        if SZ2D:                              # straight into the words' layout: [BLOCK_N, GPT, 1] -> [BLOCK_N, GPT]
            sp = offs_n[:, None, None] * stride_sn + g[None, :, None] * stride_sg + 0 * j[None, None, :]
            s = tl.max(tl.load(s_ptr + sp), 2)
            z = tl.max(tl.load(z_ptr + sp).to(tl.float32), 2)
        else:
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :] * stride_sg)                  # [BLOCK_N, GPT]
            z = tl.load(z_ptr + offs_n[:, None] * stride_sn + g[None, :] * stride_sg).to(tl.float32)
        xk = x_ptr + g[:, None] * GROUP + 8 * j[None, :]                      # [GPT, NW]: input 8 j + m of group g
        acc = tl.full([BLOCK_N, GPT, NW], 0.0, tl.float32)
        if TRICK:
            xs = tl.full([GPT, NW], 0.0, tl.float32)
            ai = tl.full([BLOCK_N, GPT, NW], 0, tl.int32)
            for m in tl.static_range(8):
                if ABL == 1 or ABL == 3:
                    f = words
                elif m <= 4:
                    f = ((words << (19 - 4 * m)) & 0x00780000) | 0x3F800000
                else:
                    f = ((words >> (4 * m - 19)) & 0x00780000) | 0x3F800000
                if ABL == 2 or ABL == 3:
                    xm = x0 + m
                else:
                    xm = tl.load(xk + m).to(tl.float32)
                if ABL == 4:
                    ai ^= f
                else:
                    acc += f.to(tl.float32, bitcast=True) * xm[None, :, :]
                xs += xm
            if ABL == 4:
                acc = ai.to(tl.float32, bitcast=True)
            total += acc * (16.0 * s)[:, :, None] - (s * (16.0 + z))[:, :, None] * xs[None, :, :]
        else:
            zc = z + 8388608.0
            for m in tl.static_range(8):
                q = ((words >> (4 * m)) & 15) | 0x4B000000
                acc += (q.to(tl.float32, bitcast=True) - zc[:, :, None]) * tl.load(xk + m).to(tl.float32)[None, :, :]
            total += acc * s[:, :, None]
        words = tl.load(wp + tl.minimum(c + 1, c_end - 1) * GPT * NW)
    if LATE: pdl_launch_next(PDL)
    acc = tl.sum(tl.sum(total, 2), 1)[None, :]                                # [1, BLOCK_N]
    finish_split(acc, bias_ptr, out_ptr, part_ptr, counter_ptr, tl.arange(0, 1), offs_n, 1, N, N, pid_n, pid_k,
                 tl.num_programs(1), HAS_BIAS, SPLIT)


PAIRS_ASM = {True: _pairs_asm(True), False: _pairs_asm(False)}   # the package's PTX, bf16 and fp16 pairs
PAIRS_CACHE: dict = {}      # (x's address, shape, bf16) -> its packed pairs and sums


@triton.jit
def lab_int4h_kernel(x2_ptr, xs_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, N, K,
                     groups_per_split, stride_wn, stride_sn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUP: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                     NEG: tl.constexpr, EMULATE: tl.constexpr = False):
    """INT4 words, two weights an instruction: packed half-precision arithmetic in inline PTX (the package's
    `_pairs_asm`) on activations pre-packed in pairs (`x2`, int32 [K / 2]) with each word's input sum (`xs`,
    fp32 [K / 8]) for the zero point. The next kernel launches after the loop."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NW: tl.constexpr = GROUP // 8
    offs_n, j, g_begin, g_end, wp = _words_program(w_ptr, K, groups_per_split, stride_wn, BLOCK_N, GROUP)
    words = tl.load(wp + g_begin * NW)
    pdl_wait(PDL)
    total = tl.full([BLOCK_N, NW], 0.0, tl.float32)
    for g in range(g_begin, g_end):
        s = tl.load(s_ptr + offs_n * stride_sn + g)
        z = tl.load(z_ptr + offs_n * stride_sn + g).to(tl.float32)
        xb = x2_ptr + (g * NW + j) * 4                                        # [NW]: word j's four pairs
        x0 = tl.load(xb)
        x1 = tl.load(xb + 1)
        x2 = tl.load(xb + 2)
        x3 = tl.load(xb + 3)
        xs = tl.load(xs_ptr + g * NW + j)
        neg = tl.full([BLOCK_N, 1], NEG, tl.int32)
        if EMULATE:                           # the interpreter: the package's stand-in for the PTX
            dot = _pairs_emulated(words, x0[None, :], x1[None, :], x2[None, :], x3[None, :], neg)
        else:
            dot = tl.inline_asm_elementwise(ASM, "=f,r,r,r,r,r,r", [words, x0[None, :], x1[None, :], x2[None, :],
                                                                     x3[None, :], neg],
                                            dtype=tl.float32, is_pure=True, pack=1)      # [BLOCK_N, NW]: sum q x
        total += dot * s[:, None] - (s * z)[:, None] * xs[None, :]
        words = tl.load(wp + tl.minimum(g + 1, g_end - 1) * NW)
    pdl_launch_next(PDL)
    acc = tl.sum(total, 1)[None, :]
    finish_split(acc, bias_ptr, out_ptr, part_ptr, counter_ptr, tl.arange(0, 1), offs_n, 1, N, N, pid_n, pid_k,
                 tl.num_programs(1), HAS_BIAS, SPLIT)


def pack_pairs(x: torch.Tensor, bf16: bool):
    "x [1, K] -> (pairs int32 [K / 2]: inputs 8 j + k and 8 j + k + 4 in half precision, sums fp32 [K / 8])."
    h = x.reshape(-1).to(torch.bfloat16 if bf16 else torch.float16)
    K = h.numel()
    pairs = h.view(K // 8, 2, 4).transpose(1, 2).contiguous().view(torch.int32).reshape(-1)   # [K/8, 4, 2] -> [K/2]
    return pairs, h.float().view(K // 8, 8).sum(1)


def _outputs(x, N: int, split: int, block_n: int):
    "The output [1, N], the split partials (or the output again), the channel tiles, the split counters."
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    part = torch.empty(split, 1, N, dtype=torch.float32, device=x.device) if split > 1 else out
    n_tiles = N // block_n
    return out, part, n_tiles, split_counters(x.device, n_tiles) if split > 1 else out


def lab_int4h(x, qweight, scales, zeros, bias, cfg: dict, pdl: bool):
    """x [1, K], INT4 (group 128): the packed-pairs kernel. Its activations are packed by `pack_pairs` once per
    operand and cached, so a timing measures the kernel alone (a shipped version packs them in the kernel)."""
    N, K = qweight.shape[0], x.shape[1]
    bf16 = cfg.get("BF16", True)
    key = (x.data_ptr(), x.shape, bf16)
    if key not in PAIRS_CACHE: PAIRS_CACHE[key] = pack_pairs(x, bf16)   # once per operand: kernel time alone
    x2, xs = PAIRS_CACHE[key]
    per, split = split_tiles(K, 128, cfg["SPLIT_K"])
    out, part, n_tiles, counters = _outputs(x, N, split, cfg["BLOCK_N"])
    w = qweight.view(torch.int32)
    lab_int4h_kernel[(n_tiles, split)](
        x2, xs, w, scales, zeros, bias if bias is not None else scales, out, part, counters, N, K, per, w.stride(0),
        scales.stride(0), HAS_BIAS=bias is not None, BLOCK_N=cfg["BLOCK_N"], GROUP=128, SPLIT=split > 1,
        ASM=PAIRS_ASM[bf16], PDL=pdl, NEG=neg_pair(bf16), EMULATE=DEVICE.type != "cuda", num_warps=cfg["num_warps"],
        num_stages=1,
        **launch_options(pdl))
    return out


def lab_int4(x, qweight, scales, zeros, bias, cfg: dict, pdl: bool):
    "x [1, K] with INT4 words (group = 128); scales / zeros [N, K / G] in either memory layout."
    N, K = qweight.shape[0], x.shape[1]
    group, gpt = 128, cfg.get("GPT", 1)
    per, split = split_tiles(K, group * gpt, cfg["SPLIT_K"])
    out, part, n_tiles, counters = _outputs(x, N, split, cfg["BLOCK_N"])
    w = qweight.view(torch.int32)
    if gpt > 1:
        lab_int4g_kernel[(n_tiles, split)](
            x, w, scales, zeros, bias if bias is not None else scales, out, part, counters, N, K, per, w.stride(0),
            scales.stride(0), scales.stride(1), HAS_BIAS=bias is not None, BLOCK_N=cfg["BLOCK_N"], GROUP=group,
            GPT=gpt, SPLIT=split > 1, TRICK=cfg.get("TRICK", False), PDL=pdl, LATE=cfg.get("LATE", False),
            ABL=cfg.get("ABL", 0), SZ2D=cfg.get("SZ2D", False),
            num_warps=cfg["num_warps"], num_stages=1, **launch_options(pdl))
        return out
    lab_int4_kernel[(n_tiles, split)](
        x, w, scales, zeros, bias if bias is not None else scales, out, part, counters, N, K, per, w.stride(0),
        scales.stride(0), scales.stride(1), HAS_BIAS=bias is not None, BLOCK_N=cfg["BLOCK_N"], GROUP=group,
        SPLIT=split > 1, TRICK=cfg.get("TRICK", False), PREFETCH=cfg.get("PREFETCH", False), PDL=pdl,
        LATE=cfg.get("LATE", False), SZ2D=cfg.get("SZ2D", False), num_warps=cfg["num_warps"], num_stages=1,
        **launch_options(pdl))
    return out


@triton.jit
def lab_int8_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, N, K, tiles_per_split, stride_wn,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    PREFETCH: tl.constexpr, PDL: tl.constexpr, LATE: tl.constexpr):
    if not LATE: pdl_launch_next(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, K // BLOCK_K)
    wp = w_ptr + offs_n[:, None] * stride_wn + k[None, :]
    u = tl.load(wp + t_begin * BLOCK_K).to(tl.int32)                          # [BLOCK_N, BLOCK_K] bytes
    pdl_wait(PDL)
    tile = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for t in range(t_begin, t_end):
        if PREFETCH:
            nxt = tl.load(wp + tl.minimum(t + 1, t_end - 1) * BLOCK_K).to(tl.int32)
        w = (u ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0        # bits of 2^23 + (q + 128), minus that
        tile += w * tl.load(x_ptr + t * BLOCK_K + k).to(tl.float32)[None, :]
        if PREFETCH:
            u = nxt
        else:
            u = tl.load(wp + tl.minimum(t + 1, t_end - 1) * BLOCK_K).to(tl.int32)
    if LATE: pdl_launch_next(PDL)
    acc = tl.sum(tile, 1)[None, :] * tl.load(s_ptr + offs_n)[None, :]
    finish_split(acc, bias_ptr, out_ptr, part_ptr, counter_ptr, tl.arange(0, 1), offs_n, 1, N, N, pid_n, pid_k,
                 tl.num_programs(1), HAS_BIAS, SPLIT)


def lab_int8(x, qweight, scales, zeros, bias, cfg: dict, pdl: bool):
    "x [1, K] with INT8 per-channel weights."
    N, K = qweight.shape[0], x.shape[1]
    per, split = split_tiles(K, cfg["BLOCK_K"], cfg["SPLIT_K"])
    out, part, n_tiles, counters = _outputs(x, N, split, cfg["BLOCK_N"])
    w = qweight.view(torch.uint8)
    lab_int8_kernel[(n_tiles, split)](
        x, w, scales, bias if bias is not None else scales, out, part, counters, N, K, per, w.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT=split > 1,
        PREFETCH=cfg.get("PREFETCH", False), PDL=pdl, LATE=cfg.get("LATE", False), num_warps=cfg["num_warps"],
        num_stages=1, **launch_options(pdl))
    return out


RUNS = {"int4": lab_int4, "int8": lab_int8, "int4h": lab_int4h}   # a sweep's method -> its lab launcher


def layer_case(method: str, N: int, K: int, bias: bool):
    """One 7B projection at one row: bf16 weight, bias, input, its quantized form, its bytes, copies for
    graph_bench, and the fp32 reference output."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(N, device=DEVICE, dtype=torch.bfloat16, generator=g) if bias else None
    x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16, generator=g)
    q = quantize_int8(w) + (None,) if method == "int8" else quantize_int4(w, 128)
    qb = tensor_bytes(q)
    ref = quant_matmul_ref(x.float(), *q, None if b is None else b.float(), method, 128)
    return w, b, x, q, qb, operand_copies(q, qb), ref


def transposed(t: torch.Tensor) -> torch.Tensor:
    "The same [N, G] values stored [G, N] (a strided view)."
    return t.t().contiguous().t()


def shipped_us(x, qs, b, method: str, qb: int) -> list[float]:
    "The control: microseconds per pass of the package's path as `quant_matmul` picks it (PDL on a GPU; none here)."
    pdl = DEVICE.type == "cuda"
    return graph_bench(lambda i: (lambda: quant_matmul(x, *qs[i], b, method, 128, pdl=pdl)), qb, device=DEVICE)


def time_trial(row: dict, label: str, run, x, ops, b, cfg: dict, pdl: bool, ref, qb: int):
    """One configuration of a lab kernel on one projection: checked against `ref` (an ablation, ABL, is wrong by
    design: no error kept), then timed; appended to row["trials"] and returned (None, the error kept, when it does
    not compile). A kernel more than 2% off fails the run."""
    try:
        err = max_rel_err(run(x, *ops[0], b, cfg, pdl), ref)
        if cfg.get("ABL"): err = None                          # wrong by design
        us = graph_bench(lambda i: (lambda: run(x, *ops[i], b, cfg, pdl)), qb, device=DEVICE)
    except Exception as e:                                      # a config that does not compile
        row["trials"].append({**cfg, "pdl": pdl, "error": repr(e)[:200]}); return None
    r = trial_row({**cfg, "pdl": pdl}, us, err, qb)
    row["trials"].append(r)
    print(label, row["layer"], r, flush=True)
    checked(err, (label, row["layer"], cfg))
    return r


def lab(res, method: str, budget_s: float, smoke: bool):
    """Per 7B projection at one row: the shipped path (as `quant_matmul` picks it), then the lab kernel's switches
    at the shipped blocks, then a block and split sweep with the best switches (`budget_s` per projection)."""
    rows = res.setdefault(method, [])
    run, method = RUNS[method], method[:4]
    for name, N, K, bias in layer_shapes("7B", smoke, TINY):
        t0 = time.perf_counter()
        w, b, x, q, qb, qs, ref = layer_case(method, N, K, bias)
        qst = [(a, transposed(s), None if z is None else transposed(z)) for a, s, z in qs] if method == "int4" else None
        shipped = dict(quant_tables()["tuned_gemv"].get((method, N, K), {}))
        row = {"layer": name, "N": N, "K": K, "bytes": qb, "shipped": shipped,
               "few_rows_gemm": quant_tables()["few_rows_gemm"].get((method, N, K)),
               "shipped_us": shipped_us(x, qs, b, method, qb), "trials": []}
        row["shipped_GBps"] = qb / min(row["shipped_us"]) / 1e3

        def trial(cfg, pdl):
            ops = qst if cfg.get("SCALES_T") else qs
            return time_trial(row, method, run, x, ops, b, cfg, pdl and DEVICE.type == "cuda", ref, qb)

        base = {"BLOCK_N": shipped.get("BLOCK_N", 64), "num_warps": shipped.get("num_warps", 4),
                "SPLIT_K": shipped.get("SPLIT_K", 8)}
        if method == "int8": base["BLOCK_K"] = shipped.get("BLOCK_K", 256)
        switches = (["TRICK", "PREFETCH", "SCALES_T", "LATE"] if method == "int4" else ["PREFETCH", "LATE"])
        combos = [{}] + [{s: True} for s in switches] + [{s: True for s in switches}]
        if method == "int4": combos += [{"TRICK": True, "PREFETCH": True}, {"TRICK": True, "PREFETCH": True,
                                                                          "SCALES_T": True}]
        for c in combos[:2] if smoke else combos:
            for pdl in (False, True):
                if pdl is False and c.get("LATE"): continue
                trial({**base, **c}, pdl)
        ok = [r for r in row["trials"] if "us" in r]
        best = min(ok, key=lambda r: r["best_us"])
        sw = {s: best.get(s, False) for s in switches}
        pdl = best["pdl"]
        bns = (64, 128, 256) if method == "int4" else (16, 32, 64)
        bks = (None,) if method == "int4" else (128, 256, 512)
        for bn in bns:
            for bk in bks:
                for nw in (4, 8):
                    for sk in (4, 8, 14) if K < 10000 else (8, 16, 37):
                        if time.perf_counter() - t0 > budget_s or (smoke and len(row["trials"]) > 4): break
                        cfg = {"BLOCK_N": bn, "num_warps": nw, "SPLIT_K": sk, **sw}
                        if bk is not None: cfg["BLOCK_K"] = bk
                        trial(cfg, pdl)
        best_trial(row)
        print(method, name, "shipped", min(row["shipped_us"]), "best", row["best"], flush=True)
        rows.append(row)
        del qs, qst, w; torch.cuda.empty_cache()


@triton.jit
def lab_read_kernel(w_ptr, out_ptr, N, KW, chunks_per_split, stride_wn, BLOCK_N: tl.constexpr, W: tl.constexpr):
    "Reads [BLOCK_N, W] int32 tiles (runs of 4 W bytes per row) and xors them: the copy speed of a tile shape."
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, W)
    c_end = tl.minimum((pid_k + 1) * chunks_per_split, KW // W)
    acc = tl.zeros([BLOCK_N, W], tl.int32)
    for c in range(pid_k * chunks_per_split, c_end):
        acc ^= tl.load(w_ptr + offs_n[:, None] * stride_wn + c * W + j[None, :])
    tl.store(out_ptr + pid_k * N + offs_n, tl.xor_sum(acc, 1))


def read_speed(res, smoke: bool):
    "Copy speed of the 7B INT4 gate/up weights (int32 words) read in row runs of 64 to 1024 bytes."
    rows = res.setdefault("read", [])
    layers = (("gate_up_proj", 37888, 3584), ("down_proj", 3584, 18944), ("qkv_proj", 4608, 3584))
    for name, N, K in [(n, N, K) for n, N, K, _ in TINY] if smoke else layers:
        w = torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, device=DEVICE)
        nbytes = w.numel() * 4
        ws = operand_copies((w,), nbytes)
        for W in (16, 32) if smoke else (16, 32, 64, 128, 256):
            for bn in (16,) if smoke else (16, 64, 256):
                if bn * W > 16384 or (K // 8) % W: continue      # the tiles must cover K
                for sk in (4,) if smoke else (4, 8, 16):
                    per, split = split_tiles(K // 8, W, sk)
                    out = torch.empty(split, N, dtype=torch.int32, device=DEVICE)
                    run = lambda i: (lambda: lab_read_kernel[(N // bn, split)](ws[i][0], out, N, K // 8, per, K // 8,
                                                                             BLOCK_N=bn, W=W, num_warps=4))
                    us = graph_bench(run, nbytes, device=DEVICE)
                    r = {"layer": name, "N": N, "K": K, "run_bytes": 4 * W, "BLOCK_N": bn, "SPLIT_K": split,
                         "us": us, "GBps": nbytes / min(us) / 1e3}
                    print("read", r, flush=True)
                    rows.append(r)
        del ws, w; torch.cuda.empty_cache()


def sweep(res, key, method, cands, budget_s, smoke):
    "Per 7B projection: the shipped path, then each candidate (config, pdl) of the lab kernel, within `budget_s`."
    rows = res.setdefault(key, [])
    run, method = RUNS[method], method[:4]
    for name, N, K, bias in layer_shapes("7B", smoke, TINY):
        t0 = time.perf_counter()
        w, b, x, q, qb, qs, ref = layer_case(method, N, K, bias)
        row = {"layer": name, "N": N, "K": K, "bytes": qb, "shipped_us": shipped_us(x, qs, b, method, qb), "trials": []}
        for cfg, pdl in cands(N, K)[:2] if smoke else cands(N, K):
            if time.perf_counter() - t0 > budget_s: break
            if N % cfg["BLOCK_N"] or (method == "int4" and (K // 128) % cfg.get("GPT", 1)): continue
            time_trial(row, key, run, x, qs, b, cfg, pdl and DEVICE.type == "cuda", ref, qb)
        if best_trial(row): print(key, name, "shipped", min(row["shipped_us"]), "best", row["best"], flush=True)
        rows.append(row)
        del qs, w; torch.cuda.empty_cache()


def int4g_cands(N, K):
    "Groups per load x blocks x warps x splits, the nibble trick on, PDL with the late launch (and once without PDL)."
    sks = (4, 8, 14) if K < 10000 else (8, 16, 37)
    out = []
    for gpt in (4, 2):
        for bn in (32, 64, 128):
            for nw in (4, 8):
                for sk in sks:
                    out.append(({"BLOCK_N": bn, "num_warps": nw, "SPLIT_K": sk, "GPT": gpt, "TRICK": True,
                                 "LATE": True}, True))
    return out


def abl_cands(N, K):
    "The best INT4 lab configurations of the int4g sweep with each ablation (results wrong by design)."
    best = {4608: (128, 2, 8), 3584: (64, 4, 14) if K == 3584 else (64, 2, 16), 37888: (64, 2, 4)}.get(N, (64, 2, 2))
    bn, gpt, sk = best
    return [({"BLOCK_N": bn, "num_warps": 4, "SPLIT_K": sk, "GPT": gpt, "TRICK": True, "LATE": True, "ABL": a}, True)
            for a in (0, 1, 2, 3, 4)]


def sz_cands(N, K):
    "Scales and zeros loaded into the words' layout (SZ2D) or broadcast (the control), one and several groups a load."
    sks = (4, 8, 14) if K < 10000 else (8, 16, 37)
    return [({"BLOCK_N": bn, "num_warps": 4, "SPLIT_K": sk, "GPT": gpt, "TRICK": True, "LATE": True, "SZ2D": sz}, True)
            for gpt in (1, 2) for bn in (64, 128, 256) for sk in sks for sz in (True, False)]


def half_cands(N, K):
    "The packed-pairs kernel (bf16 and fp16 pairs) over blocks, warps and splits, with PDL."
    sks = (4, 8, 14) if K < 10000 else (8, 16, 37)
    return [({"BLOCK_N": bn, "num_warps": nw, "SPLIT_K": sk, "BF16": bf}, True)
            for bf in (True, False) for bn in (64, 128, 256) for nw in (4, 8) for sk in sks]


def int8b_cands(N, K):
    "Longer row runs (BLOCK_K up to 1024 bytes) x blocks x warps x splits, PDL with the late launch."
    sks = (4, 8, 14) if K < 10000 else (8, 16, 37)
    return [({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "SPLIT_K": sk, "LATE": True}, True)
            for bk in (1024, 512) for bn in (8, 16, 32, 64) for nw in (4, 8) for sk in sks if bn * bk <= 32768]


def main():
    args = parser(__doc__, parts="int4,int8").parse_args()
    device_or_skip(args)
    smoke = is_smoke(args)
    res = {"timer": "graph_bench (us per call, two passes)"}
    parts = {"int4": lambda: lab(res, "int4", 35.0, smoke), "int8": lambda: lab(res, "int8", 20.0, smoke),
             "read": lambda: read_speed(res, smoke),
             "int4g": lambda: sweep(res, "int4g", "int4", int4g_cands, 45.0, smoke),
             "int8b": lambda: sweep(res, "int8b", "int8", int8b_cands, 25.0, smoke),
             "abl": lambda: sweep(res, "abl", "int4", abl_cands, 60.0, smoke),
             "sz": lambda: sweep(res, "sz", "int4", sz_cands, 60.0, smoke),
             "half": lambda: sweep(res, "half", "int4h", half_cands, 30.0, smoke)}
    run_parts(parts, ",".join(parts) if smoke else args.parts, saver("quant_lab_h200.json", res, args))
    exit_if_failed(res)


if __name__ == "__main__":
    main()

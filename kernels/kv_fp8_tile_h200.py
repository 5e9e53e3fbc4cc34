"""Why an fp8 K/V cache does not read faster than bf16 in the decode kernel: a bare decode loop, four ways.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/kv_fp8_tile_h200.py --out $OUT

`kv_fp8_h200.py` found the package's decode kernel over an fp8 cache at ~1.8 TB/s of fp8 bytes against ~4.0 TB/s
for bf16 (batch 256, 1,024-token contexts, Qwen3-0.6B's heads): slower than bf16 for half the bytes. This script
isolates the tile loop (one program per sequence and KV head, no splits, no RoPE, contiguous blocks) and times it
inside CUDA graphs over caches that miss L2, for:
- bf16: the bf16 cache, bf16 products (the control);
- fp8->f16: the fp8 cache widened to fp16 after the load, fp16 products (what the package does);
- fp8 dot: the fp8 cache's tiles into fp8 products as they are (the query and probabilities rounded to fp8: the
  hardware's limit for this loop, not an accurate kernel);
- fp8 k only: keys fp8 (widened), values bf16 (which of the two tiles costs);
- fp8 pairs: the fp8 cache read as 16-bit words, each widened to two fp16 values by bit arithmetic in registers
  (`widen_e4m3`), so that no fp8 tensor reaches Triton's layout conversions;
- "paged": bf16 and fp8->f16 through a block table of int64 ids, addresses as the package's `paged_kv` makes them;
  "paged rows": each key's offset in int64 once, the columns added in int32; "paged ids": one id a block (not one a
  key), broadcast; "paged ahead": those ids for the next tile loaded a tile ahead.
Each is checked against torch on the same cache (relative error) and timed twice. Writes kv_fp8_tile_h200.json.
`--smoke`: tiny sizes on the CPU, interpreted (the fp8 dot skipped: the interpreter cannot).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import device_or_skip, disagree, graph_bench, is_smoke, median, parser, warm, write  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

FP8 = torch.float8_e4m3fn


@triton.jit
def widen_e4m3(b):
    "fp8 e4m3 bytes (in 16-bit integers) to fp16 by bit arithmetic: sign and 7 bits moved into fp16's, times 2^8."
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def load_pairs(ptr, off2, mask, TILE_N: tl.constexpr, D: tl.constexpr):
    "A [TILE_N, D] fp8 tile read as [TILE_N, D/2] 16-bit words (two values each), widened to fp16 in registers."
    w = tl.load(ptr + off2, mask=mask, other=0).to(tl.int32)
    return tl.reshape(tl.join(widen_e4m3(w & 0xFF), widen_e4m3(w >> 8)), (TILE_N, D))


@triton.jit
def tile_loop_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, ctx, scale_log2, G: tl.constexpr, BLOCK_G: tl.constexpr,
                     D: tl.constexpr, KVH: tl.constexpr, TILE_N: tl.constexpr, MODE: tl.constexpr,
                     PAGED: tl.constexpr = 0, BS: tl.constexpr = 16):
    "One (sequence, KV head): softmax(q k^T) v over `ctx` contiguous keys [seq, pos, KVH, D]; MODE picks the dtypes."
    seq, kvh = tl.program_id(0), tl.program_id(1)
    g, d, n = tl.arange(0, BLOCK_G), tl.arange(0, D), tl.arange(0, TILE_N)
    gm = g[:, None] < G
    q = tl.load(q_ptr + (seq * KVH * G + kvh * G + g[:, None]) * D + d[None, :], mask=gm, other=0.0)
    if MODE == 1 or MODE == 4: q = q.to(tl.float16)
    if MODE == 2: q = q.to(tl.float8e4nv)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, D], 0.0, tl.float32)
    base = seq * ctx * KVH * D + kvh * D
    if PAGED == 4: ids_next = tl.load(table_ptr + seq * (ctx // BS) + tl.arange(0, TILE_N // BS))
    for t in range(0, tl.cdiv(ctx, TILE_N)):
        pos = t * TILE_N + n
        off = base + pos[:, None] * (KVH * D) + d[None, :]
        if MODE == 4:                    # the caches as 16-bit words: [.., D/2]
            off2 = base // 2 + pos[:, None] * (KVH * D // 2) + tl.arange(0, D // 2)[None, :]
            k = load_pairs(k_ptr, off2, (pos < ctx)[:, None], TILE_N, D)
            v = load_pairs(v_ptr, off2, (pos < ctx)[:, None], TILE_N, D)
        else:
            if PAGED == 1:                   # through a block table of int64 ids, as the package's `paged_kv`
                blk = tl.load(table_ptr + seq * (ctx // BS) + pos // BS, mask=pos < ctx, other=0)
                off = blk[:, None] * (BS * KVH * D) + (pos % BS)[:, None] * (KVH * D) + kvh * D + d[None, :]
            if PAGED == 2:                   # the same, the row's offset in int64 once, the columns added as int32
                blk = tl.load(table_ptr + seq * (ctx // BS) + pos // BS, mask=pos < ctx, other=0)
                row = blk * (BS * KVH * D) + ((pos % BS) * (KVH * D) + kvh * D).to(tl.int64)
                off = row[:, None] + d[None, :]
            if PAGED == 3:                   # one id a block, broadcast to its keys
                ids = tl.load(table_ptr + seq * (ctx // BS) + t * (TILE_N // BS) + tl.arange(0, TILE_N // BS))
                blk = tl.reshape(tl.broadcast_to(ids[:, None], (TILE_N // BS, BS)), (TILE_N,))
                off = blk[:, None] * (BS * KVH * D) + (pos % BS)[:, None] * (KVH * D) + kvh * D + d[None, :]
            if PAGED == 4:                   # one id a block, the next tile's loaded a tile ahead
                blk = tl.reshape(tl.broadcast_to(ids_next[:, None], (TILE_N // BS, BS)), (TILE_N,))
                nxt = (t + 1) * (TILE_N // BS) + tl.arange(0, TILE_N // BS)
                ids_next = tl.load(table_ptr + seq * (ctx // BS) + nxt, mask=nxt < ctx // BS, other=0)
                off = blk[:, None] * (BS * KVH * D) + (pos % BS)[:, None] * (KVH * D) + kvh * D + d[None, :]
            k = tl.load(k_ptr + off, mask=(pos < ctx)[:, None], other=0.0)
            v = tl.load(v_ptr + off, mask=(pos < ctx)[:, None], other=0.0)
        if MODE == 1:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        if MODE == 3:
            k = k.to(tl.bfloat16)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where((pos < ctx)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (seq * KVH * G + kvh * G + g[:, None]) * D + d[None, :], out, mask=gm)


MODES = {"bf16": (0, 0), "fp8->f16": (1, 0), "fp8 dot": (2, 0), "fp8 k only": (3, 0), "fp8 pairs": (4, 0),
         "bf16 paged": (0, 1), "fp8->f16 paged": (1, 1), "bf16 paged rows": (0, 2), "fp8->f16 paged rows": (1, 2),
         "fp8->f16 paged ids": (1, 3), "fp8->f16 paged ahead": (1, 4), "bf16 paged ids": (0, 3)}


def caches(mode, k, v):
    if mode.startswith("bf16"): return k.to(torch.bfloat16), v.to(torch.bfloat16)
    if mode == "fp8 k only": return k.to(FP8), v.to(torch.bfloat16)
    return k.to(FP8), v.to(FP8)


def ref(q, k, v, B, G, KVH, D):
    "torch on the same cache values: [B, KVH*G, D]."
    kk = k.float().view(B, -1, KVH, D).transpose(1, 2)                       # [B, KVH, ctx, D]
    vv = v.float().view(B, -1, KVH, D).transpose(1, 2)
    qq = q.float().view(B, KVH, G, D)
    p = torch.softmax(qq @ kk.transpose(-1, -2) * D ** -0.5, -1)
    return (p @ vv).reshape(B, KVH * G, D)


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--name", default="kv_fp8_tile_h200.json", help="the data file's name")
    ap.add_argument("--modes", default="", help="comma-separated modes to run (default: all)")
    args = ap.parse_args()
    smoke = is_smoke(args)
    device = device_or_skip(args)
    B, H, KVH, D, ctx, tile = (2, 4, 2, 16, 40, 16) if smoke else (256, 16, 8, 128, 1024, 128)
    G = H // KVH
    k = torch.randn(B * ctx, KVH, D, device=device)
    v = torch.randn(B * ctx, KVH, D, device=device)
    q = torch.randn(B, H, D, device=device).to(torch.float32 if smoke else torch.bfloat16)
    rows = []
    table = torch.arange(B * ctx // 16 if not smoke else B * ctx // 4, device=device)     # [B * blocks]: in order
    only = set(args.modes.split(",")) if args.modes else set(MODES)
    for mode, (code, paged) in MODES.items():
        if mode not in only: continue
        if smoke and (mode.startswith("bf16") or mode in ("fp8 dot", "fp8 k only")): continue          # the interpreter: no bf16, no fp8 dot
        kc, vc = caches(mode, k, v)
        kp, vp = (kc.view(torch.int16), vc.view(torch.int16)) if mode == "fp8 pairs" else (kc, vc)   # [.., D/2] words
        out = torch.empty(B, H, D, device=device, dtype=torch.float32)
        call = lambda: tile_loop_kernel[(B, KVH)](q, kp, vp, out, table, ctx, D ** -0.5 * 1.4426950408889634, G=G,
                                                  BLOCK_G=max(16, G), D=D, KVH=KVH, TILE_N=tile, MODE=code,
                                                  PAGED=paged, BS=4 if smoke else 16, num_warps=4)
        call()
        expected = ref(q, kc, vc, B, G, KVH, D)
        err = ((out - expected).norm() / expected.norm()).item()
        nbytes = kc.numel() * kc.element_size() + vc.numel() * vc.element_size()
        times = []
        for _ in range(2):
            warm(device, 0.5)
            times.append(median(graph_bench(lambda i: call, nbytes, device=device)))
        rows.append({"mode": mode, "rel_err": err, "us": times, "disagree": disagree(*times), "bytes": nbytes,
                     "GBps": nbytes / (median(times) * 1e-6) / 1e9})
        print(rows[-1], flush=True)
    write(args.name, {"batch": B, "heads": [H, KVH, D], "context": ctx, "tile": tile, "rows": rows}, args)


if __name__ == "__main__":
    main()

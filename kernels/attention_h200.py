"""Check and time the Triton attention kernels on the GPU (issue: fused Triton paged attention).

Run on the device machine from the repo root:  PYTHONPATH=. python kernels/attention_h200.py --out $OUT
Writes attention_h200.json (raw numbers, git sha, GPU, versions, date); copy it to figures/data/.

1. Correctness in bf16 against an fp32 torch reference (relative error ||out - ref|| / ||ref||), fresh random
   inputs for every check, output poisoned with NaN before every run: rope_cache, decode (block sizes 16/32,
   kv-head ratios 1/2/7, ragged contexts, split-K off and on), prefill (chunks with cached prefixes).
2. Decode timing, per layer, Qwen2.5-0.5B attention shape (14 heads, 2 KV heads, head_dim 64) and 7B's
   (28/4/128), block size 16: Triton kernel vs gather + SDPA (`decode_attention_ref`), batch x context grid.
   K/V come from a 4 GiB pool through random block tables, rotating over 16 table sets so that repeated calls
   do not hit L2. Bytes = K and V of every context token, read once. Each row timed twice (median of
   do_bench), disagreement over 15% flagged.
3. Prefill timing: one 512-token chunk over 0 and 1536 cached tokens, kernel vs per-chunk reference.
"""
import argparse, json, math, os, subprocess, sys, time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from nanoserve.attention import (choose_num_splits, decode_attention, decode_attention_ref, num_sms,
                                 prefill_attention, prefill_attention_ref, rope_cache, rope_cache_ref)

DEV = torch.device("cuda")


from nanoserve.bench import run_meta as meta_info   # git sha, GPU, versions, date


def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_decode(B, H, KVH, D, bs, ctx_max, splits, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ctx = torch.randint(1, ctx_max + 1, (B,), generator=g, device=DEV).to(torch.int32)
    width = -(-ctx_max // bs) + 1
    nb = B * width + 5
    kc = torch.randn(nb, bs, KVH, D, generator=g, device=DEV).to(dtype)
    vc = torch.randn(nb, bs, KVH, D, generator=g, device=DEV).to(dtype)
    bt = torch.randperm(nb, generator=g, device=DEV)[:B * width].view(B, width).to(torch.int32)
    q = torch.randn(B, H, D, generator=g, device=DEV).to(dtype)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kc, vc, bt, ctx, D ** -0.5, int(ctx.max()), num_splits=splits, out=out)
    torch.cuda.synchronize()
    ref = decode_attention_ref(q.float(), kc.float(), vc.float(), bt.long(), ctx.long(), D ** -0.5)
    return {"B": B, "H": H, "KVH": KVH, "D": D, "block_size": bs, "ctx_max": ctx_max, "splits": splits,
            "dtype": str(dtype), "nan": bool(out.isnan().any()), "rel_err": rel(out, ref)}


def check_prefill(H, KVH, D, bs, chunks, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    width = max(-(-(n + c) // bs) for n, c in chunks) + 1
    nb = len(chunks) * width + 3
    kc = torch.randn(nb, bs, KVH, D, generator=g, device=DEV).to(dtype)
    vc = torch.randn(nb, bs, KVH, D, generator=g, device=DEV).to(dtype)
    bt = torch.randperm(nb, generator=g, device=DEV)[:len(chunks) * width].view(len(chunks), width).to(torch.int32)
    T = sum(n for n, _ in chunks)
    q = torch.randn(T, H, D, generator=g, device=DEV).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor([n for n, _ in chunks]).cumsum(0)), dtype=torch.int32, device=DEV)
    st = torch.tensor([c for _, c in chunks], dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kc, vc, bt, cu, st, max(n for n, _ in chunks), D ** -0.5, out=out)
    torch.cuda.synchronize()
    ref = prefill_attention_ref(q.float(), kc.float(), vc.float(), bt.long(), cu, st, D ** -0.5)
    return {"H": H, "KVH": KVH, "D": D, "block_size": bs, "chunks": chunks, "dtype": str(dtype),
            "nan": bool(out.isnan().any()), "rel_err": rel(out, ref)}


def check_rope(T, H, KVH, D, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g, device=DEV).to(dtype)
    ang = torch.rand(T, D // 2, generator=g, device=DEV) * 100
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    slots = torch.randperm(4 * T, generator=g, device=DEV)[:T]
    kc, vc = (torch.full((T, 4, KVH, D), float("nan"), dtype=dtype, device=DEV) for _ in range(2))
    kr, vr = (torch.zeros(T, 4, KVH, D, device=DEV) for _ in range(2))
    q = rope_cache(qkv, cos, sin, slots, kc, vc, H, KVH)
    qr = rope_cache_ref(qkv.float(), cos.float(), sin.float(), slots, kr, vr, H, KVH)
    sel = lambda c: c.view(-1, KVH, D)[slots]
    return {"T": T, "H": H, "KVH": KVH, "D": D, "dtype": str(dtype), "rel_err_q": rel(q, qr),
            "rel_err_k": rel(sel(kc), sel(kr)), "rel_err_v": rel(sel(vc), sel(vr))}


def correctness(res):
    rows, seed = [], 0
    for dtype in (torch.bfloat16, torch.float16):
        for (H, KVH, D) in ((14, 2, 64), (28, 4, 128), (8, 8, 64), (12, 2, 128)):
            for bs in (16, 32):
                for B, cmax in ((1, 3000), (5, 700), (64, 300)):
                    for splits in (1, 8):
                        seed += 1; rows.append(check_decode(B, H, KVH, D, bs, cmax, splits, dtype, seed))
    res["decode_checks"] = rows
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for (H, KVH, D) in ((14, 2, 64), (28, 4, 128), (8, 8, 64)):
            for bs in (16, 32):
                seed += 1
                rows.append(check_prefill(H, KVH, D, bs, [(300, 0), (77, 513), (1, 40), (128, 128)], dtype, seed))
    res["prefill_checks"] = rows
    res["rope_checks"] = [check_rope(257, 14, 2, 64, torch.bfloat16, 99), check_rope(33, 28, 4, 128, torch.bfloat16, 98)]
    worst = max(r["rel_err"] for r in res["decode_checks"] + res["prefill_checks"])
    any_nan = any(r["nan"] for r in res["decode_checks"] + res["prefill_checks"])
    res["correct"] = {"worst_rel_err": worst, "any_nan": any_nan, "pass": worst < 2e-2 and not any_nan}
    print("correctness:", res["correct"], flush=True)


def bench_pair(fn, reps=2):
    ts = [do_bench(fn, warmup=100, rep=300, return_mode="median") for _ in range(reps)]
    return ts, abs(ts[0] - ts[1]) / min(ts) > 0.15


def graph_ms(fns):
    "Device time per call: the calls captured once in a CUDA graph, replays timed (launch overhead removed)."
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns: f()
    torch.cuda.current_stream().wait_stream(side); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns: f()
    ts = [do_bench(g.replay, warmup=50, rep=200, return_mode="median") / len(fns) for _ in range(2)]
    return ts, abs(ts[0] - ts[1]) / min(ts) > 0.15


def decode_timing(res, bw_peak):
    rows = []
    bs, dtype = 16, torch.bfloat16
    for name, (H, KVH, D) in (("0.5B", (14, 2, 64)), ("7B", (28, 4, 128))):
        block_bytes = bs * KVH * D * 2
        nb = (2 << 30) // block_bytes                       # 2 GiB of K and 2 GiB of V
        kc = torch.randn(nb, bs, KVH, D, device=DEV, dtype=dtype)
        vc = torch.randn(nb, bs, KVH, D, device=DEV, dtype=dtype)
        for B in (1, 8, 32, 128):
            for ctx_len in (128, 512, 2048, 8192):
                if B * ctx_len > 256 * 1024: continue
                width = ctx_len // bs
                tables = [torch.randint(0, nb, (B, width), device=DEV, dtype=torch.int32) for _ in range(16)]
                cl = torch.full((B,), ctx_len, device=DEV, dtype=torch.int32)
                q = torch.randn(B, H, D, device=DEV, dtype=dtype)
                out = torch.empty_like(q)
                it = [0]
                def tri():
                    it[0] = (it[0] + 1) % 16
                    decode_attention(q, kc, vc, tables[it[0]], cl, D ** -0.5, ctx_len, out=out)
                def ref():
                    it[0] = (it[0] + 1) % 16
                    decode_attention_ref(q, kc, vc, tables[it[0]], cl, D ** -0.5)
                t_tri, d1 = bench_pair(tri)
                t_ref, d2 = bench_pair(ref)
                mk = lambda f, i: (lambda: f(i))
                def tri_i(i): decode_attention(q, kc, vc, tables[i], cl, D ** -0.5, ctx_len, out=out)
                def ref_i(i): decode_attention_ref(q, kc, vc, tables[i], cl, D ** -0.5)
                g_tri, d3 = graph_ms([mk(tri_i, i) for i in range(16)])
                g_ref, d4 = graph_ms([mk(ref_i, i) for i in range(16)])
                nbytes = B * ctx_len * KVH * D * 2 * 2
                tmin = min(g_tri)
                row = {"shape": name, "B": B, "ctx": ctx_len, "triton_ms": t_tri, "sdpa_ms": t_ref,
                       "triton_graph_ms": g_tri, "sdpa_graph_ms": g_ref,
                       "speedup_eager": min(t_ref) / min(t_tri), "speedup_graph": min(g_ref) / tmin,
                       "kv_bytes": nbytes, "GBps": nbytes / tmin / 1e6,
                       "roofline_share": nbytes / tmin / 1e6 / bw_peak,
                       "splits": choose_num_splits(B, KVH, ctx_len, max(bs, 64 if D <= 64 else 32), num_sms(DEV)),
                       "disagree": d1 or d2 or d3 or d4}
                rows.append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if not k.endswith("_ms")}, flush=True)
        del kc, vc; torch.cuda.empty_cache()
    res["decode_timing"] = rows


def prefill_timing(res):
    rows = []
    bs, dtype, (H, KVH, D) = 16, torch.bfloat16, (14, 2, 64)
    for n, cached in ((512, 0), (512, 1536), (2048, 0)):
        width = -(-(n + cached) // bs)
        nb = width + 8
        kc = torch.randn(nb, bs, KVH, D, device=DEV, dtype=dtype); vc = torch.randn_like(kc)
        bt = torch.randperm(nb, device=DEV)[:width][None].to(torch.int32)
        q = torch.randn(n, H, D, device=DEV, dtype=dtype)
        cu = torch.tensor([0, n], device=DEV, dtype=torch.int32); st = torch.tensor([cached], device=DEV, dtype=torch.int32)
        t_tri, d1 = bench_pair(lambda: prefill_attention(q, kc, vc, bt, cu, st, n, D ** -0.5))
        t_ref, d2 = bench_pair(lambda: prefill_attention_ref(q, kc, vc, bt, cu, st, D ** -0.5))
        flops = 4 * n * (cached + n / 2) * H * D
        rows.append({"tokens": n, "cached": cached, "triton_ms": t_tri, "ref_ms": t_ref, "speedup": min(t_ref) / min(t_tri),
                     "TFLOPs": flops / min(t_tri) / 1e9, "disagree": d1 or d2})
        print(rows[-1], flush=True)
    res["prefill_timing"] = rows


def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV); y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), warmup=100, rep=500, return_mode="median")
    return 2 * x.numel() / t / 1e6   # GB/s, read + write


def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res = {"meta": meta_info(), "command": "PYTHONPATH=. python kernels/attention_h200.py --out $OUT"}
    out = Path(args.out) / "attention_h200.json"
    torch.manual_seed(0)
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t0 = time.time()
    while time.time() - t0 < 3: x @ x                          # clock ramp: sustained work first
    res["copy_GBps"] = copy_bandwidth(); print("copy GB/s", res["copy_GBps"], flush=True)
    for name, fn in (("correctness", lambda: correctness(res)), ("decode", lambda: decode_timing(res, res["copy_GBps"])),
                     ("prefill", lambda: prefill_timing(res))):
        try: fn()
        except Exception as e:
            import traceback; traceback.print_exc(); res[f"{name}_error"] = repr(e)
        out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Check and time the Triton attention kernels of the attention chapter; writes attention_h200.json.

    python kernels/attention_h200.py --out figures/data     on the H200 (from the repository root)
    python kernels/attention_h200.py --smoke                the same code on tiny shapes, on the CPU, in seconds

1. Check, in bf16 and fp16 against an fp32 torch reference (relative error ||out - ref|| / ||ref||), fresh random
   inputs for every check, the output poisoned with NaN before every run: rope_cache, decode (block sizes 16/32,
   kv-head ratios 1/2/6/7, ragged contexts, split-K off and on), prefill (chunks with cached prefixes). A failed
   check stops the run before anything is timed.
2. Decode timing, per layer, the Qwen2.5 0.5B attention shape (14 heads, 2 KV heads, head_dim 64) and the 7B's
   (28/4/128), block size 16: the Triton kernel against gather + SDPA (`decode_attention_ref`), over a grid of
   batch x context. K/V come from a 4 GiB pool through random block tables, rotating over 16 table sets so that
   repeated calls miss L2. Bytes = K and V of every context token, read once. Each row is timed twice (eager:
   the median of do_bench; graph: 16 calls captured in a CUDA graph, replays timed), a disagreement over 15% flagged.
3. Prefill timing: one chunk of 512 or 2,048 tokens over 0 or 1,536 cached ones, the kernel against the per-chunk
   reference.
Under --smoke the shapes are tiny, fp16 only (the interpreter computes bf16 wrongly), and the timings are the host's
clock around eager calls (no CUDA graphs on a CPU).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import device_or_skip, disagree, is_smoke, median, parser, rel_err, time_cuda, warm, write  # noqa: E402

import torch  # noqa: E402

from nanoserve.attention import (choose_num_splits, decode_attention, decode_attention_ref, prefill_attention,  # noqa: E402
                                 prefill_attention_ref, rope_cache, rope_cache_ref, tile_n)
from nanoserve.runtime import num_sms  # noqa: E402

FULL = {
    "dtypes": (torch.bfloat16, torch.float16),
    "heads": ((14, 2, 64), (28, 4, 128), (8, 8, 64), (12, 2, 128)),
    "block_sizes": (16, 32), "decode": ((1, 3000), (5, 700), (64, 300)), "splits": (1, 8),
    "prefill_heads": ((14, 2, 64), (28, 4, 128), (8, 8, 64)), "chunks": [(300, 0), (77, 513), (1, 40), (128, 128)],
    "rope": ((257, 14, 2, 64), (33, 28, 4, 128)),
    "timing_shapes": {"0.5B": (14, 2, 64), "7B": (28, 4, 128)}, "pool_bytes": 2 << 30,
    "batches": (1, 8, 32, 128), "contexts": (128, 512, 2048, 8192), "max_tokens": 256 * 1024,
    "prefill_timing": ((512, 0), (512, 1536), (2048, 0)), "copy_bytes": 1 << 30,
}
SMOKE = {
    "dtypes": (torch.float16,), "heads": ((2, 1, 16),), "block_sizes": (16,), "decode": ((2, 40),), "splits": (1, 4),
    "prefill_heads": ((2, 1, 16),), "chunks": [(20, 0), (5, 30), (1, 7)], "rope": ((5, 2, 1, 16),),
    "timing_shapes": {"tiny": (2, 1, 16)}, "pool_bytes": 1 << 20, "batches": (1, 2), "contexts": (32,),
    "max_tokens": 64, "prefill_timing": ((16, 0), (16, 16)), "copy_bytes": 1 << 20,
}


# ---- check ---------------------------------------------------------------------------------------------------
def check_decode(dev, B, H, KVH, D, bs, ctx_max, splits, dtype, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    ctx = torch.randint(1, ctx_max + 1, (B,), generator=g, device=dev).to(torch.int32)
    width = -(-ctx_max // bs) + 1
    nb = B * width + 5
    kc = torch.randn(nb, bs, KVH, D, generator=g, device=dev).to(dtype)
    vc = torch.randn(nb, bs, KVH, D, generator=g, device=dev).to(dtype)
    bt = torch.randperm(nb, generator=g, device=dev)[:B * width].view(B, width).to(torch.int32)   # [B, width]
    q = torch.randn(B, H, D, generator=g, device=dev).to(dtype)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, kc, vc, bt, ctx, D ** -0.5, int(ctx.max()), num_splits=splits, out=out)
    ref = decode_attention_ref(q.float(), kc.float(), vc.float(), bt.long(), ctx.long(), D ** -0.5)
    return {"B": B, "H": H, "KVH": KVH, "D": D, "block_size": bs, "ctx_max": ctx_max, "splits": splits,
            "dtype": str(dtype), "nan": bool(out.isnan().any()), "rel_err": rel_err(out, ref)}


def check_prefill(dev, H, KVH, D, bs, chunks, dtype, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    width = max(-(-(n + c) // bs) for n, c in chunks) + 1
    nb = len(chunks) * width + 3
    kc = torch.randn(nb, bs, KVH, D, generator=g, device=dev).to(dtype)
    vc = torch.randn(nb, bs, KVH, D, generator=g, device=dev).to(dtype)
    bt = torch.randperm(nb, generator=g, device=dev)[:len(chunks) * width].view(len(chunks), width).to(torch.int32)
    T = sum(n for n, _ in chunks)
    q = torch.randn(T, H, D, generator=g, device=dev).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor([n for n, _ in chunks]).cumsum(0)), dtype=torch.int32, device=dev)
    st = torch.tensor([c for _, c in chunks], dtype=torch.int32, device=dev)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kc, vc, bt, cu, st, max(n for n, _ in chunks), D ** -0.5, out=out)
    ref = prefill_attention_ref(q.float(), kc.float(), vc.float(), bt.long(), cu, st, D ** -0.5)
    return {"H": H, "KVH": KVH, "D": D, "block_size": bs, "chunks": chunks, "dtype": str(dtype),
            "nan": bool(out.isnan().any()), "rel_err": rel_err(out, ref)}


def check_rope(dev, T, H, KVH, D, dtype, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g, device=dev).to(dtype)
    ang = torch.rand(T, D // 2, generator=g, device=dev) * 100
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    slots = torch.randperm(4 * T, generator=g, device=dev)[:T]
    kc, vc = (torch.full((T, 4, KVH, D), float("nan"), dtype=dtype, device=dev) for _ in range(2))
    kr, vr = (torch.zeros(T, 4, KVH, D, device=dev) for _ in range(2))
    q = rope_cache(qkv, cos, sin, slots, kc, vc, H, KVH)
    qr = rope_cache_ref(qkv.float(), cos.float(), sin.float(), slots, kr, vr, H, KVH)
    sel = lambda c: c.view(-1, KVH, D)[slots]                       # [T, KVH, D]: the slots written
    return {"T": T, "H": H, "KVH": KVH, "D": D, "dtype": str(dtype), "rel_err_q": rel_err(q, qr),
            "rel_err_k": rel_err(sel(kc), sel(kr)), "rel_err_v": rel_err(sel(vc), sel(vr))}


def correctness(dev, s) -> dict:
    "Every check of the plan `s`, and the verdict."
    res, seed = {"decode_checks": [], "prefill_checks": []}, 0
    for dtype in s["dtypes"]:
        for H, KVH, D in s["heads"]:
            for bs in s["block_sizes"]:
                for B, cmax in s["decode"]:
                    for splits in s["splits"]:
                        seed += 1
                        res["decode_checks"].append(check_decode(dev, B, H, KVH, D, bs, cmax, splits, dtype, seed))
        for H, KVH, D in s["prefill_heads"]:
            for bs in s["block_sizes"]:
                seed += 1
                res["prefill_checks"].append(check_prefill(dev, H, KVH, D, bs, s["chunks"], dtype, seed))
    res["rope_checks"] = [check_rope(dev, *shape, s["dtypes"][0], 99 - i) for i, shape in enumerate(s["rope"])]
    rows = res["decode_checks"] + res["prefill_checks"]
    worst, any_nan = max(r["rel_err"] for r in rows), any(r["nan"] for r in rows)
    res["correct"] = {"worst_rel_err": worst, "any_nan": any_nan, "pass": worst < 2e-2 and not any_nan}
    print("correctness:", res["correct"], flush=True)
    return res


# ---- time ----------------------------------------------------------------------------------------------------
def ms(fn, dev) -> float:
    "Milliseconds a call: do_bench's median on a GPU, the host clock's median on a CPU."
    if dev.type != "cuda": return median(time_cuda(fn, reps=3, warmup=1, device=dev)) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=100, rep=300, return_mode="median")


def timed_twice(fn, dev) -> tuple[list, bool]:
    ts = [ms(fn, dev), ms(fn, dev)]
    return ts, disagree(*ts)


def graph_ms(fns, dev) -> tuple[list, bool]:
    "Device time per call: the calls captured once in a CUDA graph, replays timed (launch overhead removed)."
    if dev.type != "cuda": return timed_twice(fns[0], dev)          # no graphs on a CPU: one eager call
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns: f()
    torch.cuda.current_stream().wait_stream(side); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns: f()
    ts = [ms(g.replay, dev) / len(fns) for _ in range(2)]
    return ts, disagree(*ts)


def decode_row(dev, name, H, KVH, D, kc, vc, B, ctx_len, bw_peak) -> dict:
    bs, nb = kc.shape[1], kc.shape[0]
    tables = [torch.randint(0, nb, (B, ctx_len // bs), device=dev, dtype=torch.int32) for _ in range(16)]
    cl = torch.full((B,), ctx_len, device=dev, dtype=torch.int32)
    q = torch.randn(B, H, D, device=dev, dtype=kc.dtype)
    out, it = torch.empty_like(q), [0]

    def tri_i(i): decode_attention(q, kc, vc, tables[i], cl, D ** -0.5, ctx_len, out=out)
    def ref_i(i): decode_attention_ref(q, kc, vc, tables[i], cl, D ** -0.5)
    def rotating(f):                                  # the next table set at every call
        def call(): it[0] = (it[0] + 1) % 16; f(it[0])
        return call
    t_tri, d1 = timed_twice(rotating(tri_i), dev)
    t_ref, d2 = timed_twice(rotating(ref_i), dev)
    g_tri, d3 = graph_ms([lambda i=i: tri_i(i) for i in range(16)], dev)
    g_ref, d4 = graph_ms([lambda i=i: ref_i(i) for i in range(16)], dev)
    nbytes, tmin = B * ctx_len * KVH * D * 2 * 2, min(g_tri)
    return {"shape": name, "B": B, "ctx": ctx_len, "triton_ms": t_tri, "sdpa_ms": t_ref,
            "triton_graph_ms": g_tri, "sdpa_graph_ms": g_ref,
            "speedup_eager": min(t_ref) / min(t_tri), "speedup_graph": min(g_ref) / tmin,
            "kv_bytes": nbytes, "GBps": nbytes / tmin / 1e6, "roofline_share": nbytes / tmin / 1e6 / bw_peak,
            "splits": choose_num_splits(B, KVH, ctx_len, tile_n(bs), num_sms(dev), D),
            "disagree": d1 or d2 or d3 or d4}


def decode_timing(dev, s, bw_peak) -> list:
    rows, bs, dtype = [], 16, torch.bfloat16 if dev.type == "cuda" else torch.float16
    for name, (H, KVH, D) in s["timing_shapes"].items():
        nb = s["pool_bytes"] // (bs * KVH * D * 2)           # pool_bytes of K and as much of V
        kc = torch.randn(nb, bs, KVH, D, device=dev, dtype=dtype)
        vc = torch.randn(nb, bs, KVH, D, device=dev, dtype=dtype)
        for B in s["batches"]:
            for ctx_len in s["contexts"]:
                if B * ctx_len > s["max_tokens"]: continue
                rows.append(decode_row(dev, name, H, KVH, D, kc, vc, B, ctx_len, bw_peak))
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()
                       if not k.endswith("_ms")}, flush=True)
        del kc, vc
        if dev.type == "cuda": torch.cuda.empty_cache()
    return rows


def prefill_timing(dev, s) -> list:
    rows, bs, (H, KVH, D) = [], 16, s["prefill_heads"][0]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    for n, cached in s["prefill_timing"]:
        width = -(-(n + cached) // bs)
        nb = width + 8
        kc = torch.randn(nb, bs, KVH, D, device=dev, dtype=dtype)
        vc = torch.randn(nb, bs, KVH, D, device=dev, dtype=dtype)
        bt = torch.randperm(nb, device=dev)[:width][None].to(torch.int32)                      # [1, width]
        q = torch.randn(n, H, D, device=dev, dtype=dtype)
        cu = torch.tensor([0, n], device=dev, dtype=torch.int32)
        st = torch.tensor([cached], device=dev, dtype=torch.int32)
        t_tri, d1 = timed_twice(lambda: prefill_attention(q, kc, vc, bt, cu, st, n, D ** -0.5), dev)
        t_ref, d2 = timed_twice(lambda: prefill_attention_ref(q, kc, vc, bt, cu, st, D ** -0.5), dev)
        flops = 4 * n * (cached + n / 2) * H * D
        rows.append({"tokens": n, "cached": cached, "triton_ms": t_tri, "ref_ms": t_ref,
                     "speedup": min(t_ref) / min(t_tri), "TFLOPs": flops / min(t_tri) / 1e9, "disagree": d1 or d2})
        print(rows[-1], flush=True)
    return rows


def copy_bandwidth(dev, nbytes) -> float:
    "GB/s of a device-to-device copy, read + write."
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    return 2 * x.numel() / ms(lambda: y.copy_(x), dev) / 1e6


def main():
    args = parser(__doc__).parse_args()
    dev = device_or_skip(args)
    s = SMOKE if is_smoke(args) else FULL
    torch.manual_seed(0)
    res = correctness(dev, s)                                     # check
    if not res["correct"]["pass"]: raise SystemExit(f"attention kernels failed their checks: {res['correct']}")
    warm(dev)                                                     # then time, with the clocks up
    res["copy_GBps"] = copy_bandwidth(dev, s["copy_bytes"])
    print("copy GB/s", res["copy_GBps"], flush=True)
    res["decode_timing"] = decode_timing(dev, s, res["copy_GBps"])
    res["prefill_timing"] = prefill_timing(dev, s)
    write("attention_h200.json", res, args)                       # then write


if __name__ == "__main__":
    main()

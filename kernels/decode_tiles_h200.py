"""The decode-attention kernel's tile at the families' head sizes on the H200 (issue: beyond Qwen2).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/decode_tiles_h200.py --out $OUT
Writes decode_tiles_h200.json (raw numbers, git sha, GPU, versions, date); copy it to figures/data/.

nano-vllm's workload on Qwen3-0.6B is bound by reading K/V: 112 KiB a token, head_dim 128, two query heads per KV
head. This sweeps the decode kernel's launch (`TILE_N` keys an iteration, warps, pipeline stages) around the
package's rule (`attention.tile_n`, 4 warps, Triton's default stages) for the attention shapes of Qwen3-0.6B
(16/8/128), Llama-3.2-1B (32/8/64), Llama-3.1-8B and Mistral-7B (32/8/128) and Qwen2.5-0.5B (14/2/64, the shape the
rule was tuned on), at batch 256 and 64 with ragged contexts around 1,000 tokens and at batch 1 (split-K). Block size
16, bf16, K/V in a 2 GiB pool through random block tables (16 table sets, rotated, so that calls miss L2). In the
tutorials' order: every variant is checked against `decode_attention_ref` first (relative error), then timed as 16
calls in one CUDA graph, twice (>15% apart flagged); GB/s = K and V of every context token, read once, over the
time; the share is of the copy bandwidth measured in the same run.
`--parts rope1` (also in the default): batch 1 as a decode-only engine step launches the kernel (RoPE inside, Qwen3's
q/k norms folded in, PDL where the GPU has it) at short contexts, Qwen3-0.6B's and Qwen2.5-0.5B's heads: each split
count with every split merging (the control) against the count CUDA graphs capture (`graphs.decode_splits` picks
it for the longest context the engine allows) running only the splits the context has tiles for, checked against the reference first; written under "rope1".
`--smoke`: one tiny shape on the CPU under the Triton interpreter, written only to a temporary folder.
"""
import math, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import device_or_skip, disagree, is_smoke, parser, rel_err, write  # noqa: E402

import torch  # noqa: E402

from nanoserve.attention import (choose_num_splits, decode_attention, decode_attention_kernel,  # noqa: E402
                                 decode_attention_ref, rope_cache_ref, split_buffers, tile_n)
from nanoserve.measure import copy_bandwidth_GBps  # noqa: E402
from nanoserve.runtime import INTERPRET, num_sms, pdl_supported  # noqa: E402

SHAPES = {"qwen3-0.6B": (16, 8, 128), "llama3.2-1B": (32, 8, 64), "llama3.1-8B": (32, 8, 128),
          "qwen2.5-0.5B": (14, 2, 64)}
CASES = ((256, 1024), (64, 1024), (1, 2048))          # (batch, the longest context; contexts uniform in [ctx/8, ctx])
TILES, WARPS, STAGES = (32, 64, 128), (4, 8), (None, 2, 4)   # None: Triton's default


def launch(q, kc, vc, bt, cl, max_ctx, out, tile, warps, stages):
    "The package's decode launcher with the tile, warps and stages given (rope off, in-kernel merge)."
    B, H, D = q.shape
    KVH = kc.shape[2]
    splits = choose_num_splits(B, KVH, max_ctx, tile, num_sms(q.device), D)
    part_out, part_lse, counters = split_buffers(out, KVH, splits, splits > 1)
    extra = {} if stages is None else {"num_stages": stages}
    decode_attention_kernel[(B, KVH, splits)](
        q, kc, vc, bt, cl, out, part_out, part_lse, counters, D ** -0.5 * math.log2(math.e),
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0), out.stride(0), out.stride(1),
        q, q, q, 0, q, q, 0.0, q, NUM_HEADS=H, G=H // KVH, BLOCK_G=max(16, 1 << (H // KVH - 1).bit_length()),
        HEAD_DIM=D, BLOCK_SIZE=kc.shape[1], TILE_N=tile, NUM_SPLITS=splits, MERGE=splits > 1, UPCAST=INTERPRET,
        num_warps=warps, **extra)
    return splits


def graph_ms(calls, dev) -> tuple[list, bool]:
    "ms a call: the calls in one CUDA graph, its replays timed twice; one eager pass by the host clock on a CPU."
    import time
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for c in calls: c()
        return [(time.perf_counter() - t0) * 1e3 / len(calls)] * 2, False
    for c in calls: c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls: c()
    out = []
    for _ in range(2):
        g.replay(); torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10): g.replay()
        b.record(); b.synchronize()
        out.append(a.elapsed_time(b) / (10 * len(calls)))
    return out, disagree(*out)


def sweep(dev, name, H, KVH, D, B, max_ctx, pool_bytes, bw, smoke) -> list:
    "Every (tile, warps, stages) variant at one shape and batch: checked, then timed."
    bs, dtype = 16, torch.float16 if smoke else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(B * 131 + D)
    nb = max(pool_bytes // (2 * bs * KVH * D * 2), B * (max_ctx // bs + 1))
    kc = torch.randn(nb, bs, KVH, D, device=dev, dtype=dtype, generator=g)
    vc = torch.randn_like(kc)
    cl = torch.randint(max(1, max_ctx // 8), max_ctx + 1, (B,), device=dev, dtype=torch.int32, generator=g)
    width = -(-max_ctx // bs)
    tables = [torch.randint(0, nb, (B, width), device=dev, dtype=torch.int32, generator=g) for _ in range(16)]
    q = torch.randn(B, H, D, device=dev, dtype=dtype, generator=g)
    ref = decode_attention_ref(q.float(), kc.float(), vc.float(), tables[0].long(), cl.long(), D ** -0.5)
    nbytes = int(cl.sum()) * KVH * D * 2 * 2
    rows, shipped = [], (tile_n(bs), 4, None)
    for tile in ((16,) if smoke else TILES):
        for warps in ((4,) if smoke else WARPS):
            for stages in ((None,) if smoke else STAGES):
                out = torch.full_like(q, float("nan"))
                try:
                    splits = launch(q, kc, vc, tables[0], cl, max_ctx, out, tile, warps, stages)
                except Exception as e:                    # a variant that does not fit (registers, shared memory)
                    rows.append({"tile": tile, "warps": warps, "stages": stages, "error": repr(e)[:200]}); continue
                err = rel_err(out.float(), ref)
                assert err < 2e-2, (name, B, tile, warps, stages, err)
                t, flag = graph_ms([lambda i=i: launch(q, kc, vc, tables[i], cl, max_ctx, out, tile, warps, stages)
                                    for i in range(2 if smoke else 16)], dev)
                row = {"tile": tile, "warps": warps, "stages": stages, "splits": splits, "rel_err": err, "ms": t,
                       "disagree": flag, "GBps": nbytes / min(t) / 1e6, "share": nbytes / min(t) / 1e6 / bw,
                       "shipped": (tile, warps, stages) == shipped}
                print(name, B, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                rows.append(row)
    del kc, vc
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: min(r["ms"]))
    base = next(r for r in ok if r["shipped"])
    return [{"shape": name, "heads": [H, KVH, D], "batch": B, "max_ctx": max_ctx, "kv_bytes": nbytes, "rows": rows,
             "best": best, "shipped": base, "best_over_shipped": min(base["ms"]) / min(best["ms"])}]


def rope1_case(dev, H, KVH, D, ctx, dtype, bs=16):
    "One sequence of `ctx` tokens, its QKV row, cos/sin and Qwen3-style norms; the reference output and caches."
    g = torch.Generator(device=dev).manual_seed(ctx)
    nb = max(64, ctx // bs + 2)
    kc = torch.randn(nb, bs, KVH, D, device=dev, dtype=dtype, generator=g); vc = torch.randn_like(kc)
    table = torch.randperm(nb, device=dev, generator=g)[: -(-ctx // bs)].view(1, -1).to(torch.int32)
    cl = torch.tensor([ctx], device=dev, dtype=torch.int32)
    slot = (table[0, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs).view(1)
    qkv = torch.randn(1, (H + 2 * KVH) * D, device=dev, dtype=dtype, generator=g)
    ang = torch.rand(1, D // 2, device=dev, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    norm = tuple(1 + 0.5 * torch.randn(D, device=dev, generator=g) for _ in range(2))
    norm = (norm[0].to(dtype), norm[1].to(dtype), 1e-6)
    kr, vr = kc.float().clone(), vc.float().clone()
    q_ref = rope_cache_ref(qkv.float(), cos.float(), sin.float(), slot, kr, vr, H, KVH,
                           qk_norm=(norm[0].float(), norm[1].float(), 1e-6))
    ref = decode_attention_ref(q_ref, kr, vr, table.long(), cl.long(), D ** -0.5)
    return (kc, vc, table, cl, (qkv, cos, sin, slot), norm), ref


def rope1(dev, bw, smoke) -> list:
    """Batch 1, RoPE and Qwen3's norms inside, at short contexts: every fixed split count with all splits merging
    (the control, `splits_by_context=False`), and the graphs' count (for a 40,960-token context) with only the
    splits the context has tiles for; each checked against rope_cache_ref +
    decode_attention_ref, then timed."""
    dtype = torch.float16 if smoke else torch.bfloat16
    pdl = pdl_supported(dev)
    shapes = {"tiny": (4, 2, 16)} if smoke else {"qwen3-0.6B": (16, 8, 128), "qwen2.5-0.5B": (14, 2, 64)}
    rows = []
    for name, (H, KVH, D) in shapes.items():
        graphs_splits = choose_num_splits(1, KVH, 64 if smoke else 40960, tile_n(16), num_sms(dev), D)
        variants = [(s, False) for s in (1, 2, 4, 8, 16)] + [(graphs_splits, True)]
        for ctx in ((20,) if smoke else (64, 200, 512, 1024, 2048)):
            (kc, vc, table, cl, rope, norm), ref = rope1_case(dev, H, KVH, D, ctx, dtype)
            out = torch.empty(1, H, D, device=dev, dtype=dtype)
            for splits, by_context in variants:
                call = lambda: decode_attention(None, kc, vc, table, cl, D ** -0.5, ctx, num_splits=splits, out=out,
                                                pdl=pdl, rope=rope, qk_norm=norm, splits_by_context=by_context)
                call()
                err = rel_err(out.float(), ref)
                assert err < 2e-2, (name, ctx, splits, by_context, err)
                t, flag = graph_ms([call] * (2 if smoke else 16), dev)
                rows.append({"shape": name, "ctx": ctx, "splits": splits, "splits_by_context": by_context,
                             "graphs_splits": graphs_splits, "rel_err": err, "ms": t,
                             "disagree": flag, "pdl": pdl})
                print("rope1", rows[-1], flush=True)
    return rows


def main():
    args = parser(__doc__, parts="tiles,rope1").parse_args()
    smoke = is_smoke(args)
    dev = device_or_skip(args)
    bw, bw_flag = copy_bandwidth_GBps(1 << 20 if smoke else 4 << 30, dev)
    res = {"copy_bandwidth_GBps": bw, "copy_bandwidth_disagree": bw_flag, "results": []}
    shapes = {"tiny": (4, 2, 16)} if smoke else SHAPES
    if "rope1" in args.parts.split(","):
        res["rope1"] = rope1(dev, bw, smoke)
        write("decode_tiles_h200.json", res, args)
    if "tiles" not in args.parts.split(","): return
    for name, (H, KVH, D) in shapes.items():
        for B, ctx in ((2, 40),) if smoke else CASES:
            res["results"] += sweep(dev, name, H, KVH, D, B, ctx, 1 << 20 if smoke else 2 << 30, bw, smoke)
            write("decode_tiles_h200.json", res, args)
            torch.cuda.empty_cache() if dev.type == "cuda" else None
    for r in res["results"]:
        b = r["best"]
        print(f"{r['shape']:13} B={r['batch']:3}: shipped {min(r['shipped']['ms']) * 1e3:8.1f} us "
              f"({r['shipped']['share']:.0%}), best tile {b['tile']} warps {b['warps']} stages {b['stages']} "
              f"{min(b['ms']) * 1e3:8.1f} us ({b['share']:.0%}), x{r['best_over_shipped']:.2f}")


if __name__ == "__main__":
    main()

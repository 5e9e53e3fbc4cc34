"""The decode-attention kernel at the contexts of nano-vllm's workload, by split count (issues 27 and 29).

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/decode_workload_h200.py --out $OUT

In the workload profile (`workload_profile_*.json`) decode attention reads K/V at ~89% of the copy bandwidth over
the whole run, and lower at narrow widths (17-64 rows ~80%, 1-16 ~62%), where the kernel alone over contexts
uniform in 128..1,024 reached 99% at 256 rows (`decode_tiles_h200.json`). This script replays the workload's decode
steps for the kernel alone: nano-vllm's 256 requests (prompt and output uniform in 100..1,024, seed 0); at decode
step `s` the rows are the requests whose output is longer than `s`, padded to the CUDA-graph bucket, each with
`prompt + s + 1` keys. At each sampled step, Qwen3-0.6B's heads (16 / 8 / 128), bf16, block size 16, K/V in a
4 GiB pool through random block tables (2 sets of disjoint blocks, rotated), every variant is checked against the torch reference
and timed as 16 calls in one CUDA graph, twice (>15% apart flagged):

- splits 1, 2, 4, 8, 16 (only the splits a context has tiles for run, merged in the kernel, as the engine launches);
- with RoPE and Qwen3's q/k norms inside and this step's key written (the engine's launch) and without (the query
  given, its key already in the cache); and the engine's launch over an fp8 (e4m3) cache (issue 29's bytes halved;
  not under `--smoke`: the interpreter's fp8 is not faithful);
- the package's rule (`choose_num_splits` for the workload's longest context, as `graphs.decode_splits` captures).

GB/s counts K and V of every context token once. `estimate` sums each variant's time over the workload's decode
steps (each sampled step stands for the steps up to the next), for one layer: the rule's total against the best
split count at each step's width. `--smoke`: a tiny shape on the CPU under the interpreter.
"""
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from decode_tiles_h200 import graph_ms  # noqa: E402
from lab import device_or_skip, is_smoke, nanovllm_requests, parser, rel_err, run_parts, saver  # noqa: E402

import torch  # noqa: E402

from nanoserve.attention import choose_num_splits, decode_attention, decode_attention_ref, rope_cache_ref, tile_n  # noqa: E402,E501
from nanoserve.measure import copy_bandwidth_GBps  # noqa: E402
from nanoserve.runtime import num_sms  # noqa: E402

NAME = "decode_workload_h200.json"
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def workload_steps(smoke: bool) -> list[tuple[int, list[int]]]:
    "(decode step, the running rows' context lengths) at the sampled steps of nano-vllm's workload."
    reqs, _ = nanovllm_requests(smoke=smoke)
    lens = [(len(r.prompt_token_ids), r.max_tokens) for r in reqs]
    steps = (0, 2) if smoke else (0, 150, 300, 450, 600, 700, 800, 880, 940, 980, 1010)
    return [(s, [p + s + 1 for p, o in lens if o > s]) for s in steps if any(o > s for _, o in lens)]


def bucket(n: int) -> int: return next(b for b in BUCKETS if b >= n)


def make_case(dev, ctxs, H, KVH, D, pool_bytes, dtype, bs=16, seed=0, cache_dtype=None):
    """Caches (in `cache_dtype`, default `dtype`), tables (2 sets), context lengths padded to the bucket (zeros), q,
    and the engine's RoPE inputs."""
    g = torch.Generator(device=dev).manual_seed(seed)
    B, width = bucket(len(ctxs)), -(-max(ctxs) // bs)
    nb = max(pool_bytes // (2 * bs * KVH * D * 2), 2 * B * width)
    kc = torch.randn(nb, bs, KVH, D, device=dev, dtype=dtype, generator=g).to(cache_dtype or dtype)
    vc = torch.randn(nb, bs, KVH, D, device=dev, dtype=dtype, generator=g).to(cache_dtype or dtype)
    cl = torch.zeros(B, dtype=torch.int32, device=dev); cl[:len(ctxs)] = torch.tensor(ctxs, dtype=torch.int32)
    # the sets' blocks disjoint: a launch writes each row's new key, which no other row of any set reads
    perm = torch.randperm(nb, device=dev, generator=g)[: 2 * B * width].to(torch.int32)
    tables = [perm[i * B * width:(i + 1) * B * width].view(B, width) for i in range(2)]
    q = torch.randn(B, H, D, device=dev, dtype=dtype, generator=g)
    qkv = torch.randn(B, (H + 2 * KVH) * D, device=dev, dtype=dtype, generator=g)
    ang = torch.rand(B, D // 2, device=dev, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    last = (cl.long() - 1).clamp(min=0)
    slots = [(t.gather(1, (last // bs).view(-1, 1)).view(-1).long() * bs + last % bs) for t in tables]
    norm = tuple((1 + 0.5 * torch.randn(D, device=dev, generator=g)).to(dtype) for _ in range(2)) + (1e-6,)
    return dict(kc=kc, vc=vc, cl=cl, tables=tables, q=q, qkv=qkv, cos=cos, sin=sin, slots=slots, norm=norm)


def reference(c, H, KVH, D, rope: bool):
    "The torch result of table set 0 (with `rope`: rope_cache_ref on copies of the caches first)."
    kr, vr, q = c["kc"].float(), c["vc"].float(), c["q"].float()
    if rope:
        kr, vr = kr.clone(), vr.clone()
        n = c["norm"]
        q = rope_cache_ref(c["qkv"].float(), c["cos"].float(), c["sin"].float(), c["slots"][0], kr, vr, H, KVH,
                           qk_norm=(n[0].float(), n[1].float(), n[2]))
    return decode_attention_ref(q, kr, vr, c["tables"][0].long(), c["cl"].long(), D ** -0.5)


def call(c, i, splits, rope: bool, out, max_ctx):
    "The package's launcher on table set `i`: the engine's launch (`rope`) or the query given."
    kw = dict(rope=(c["qkv"], c["cos"], c["sin"], c["slots"][i]), qk_norm=c["norm"]) if rope else {}
    return decode_attention(None if rope else c["q"], c["kc"], c["vc"], c["tables"][i], c["cl"], out.shape[-1] ** -0.5,
                            max_ctx, num_splits=splits, out=out, **kw)


def sweep(res, args) -> None:
    smoke, dev = is_smoke(args), device_or_skip(args)
    H, KVH, D = (4, 2, 16) if smoke else (16, 8, 128)
    dtype = torch.float16 if smoke else torch.bfloat16
    bw, _ = copy_bandwidth_GBps(1 << 20 if smoke else 4 << 30, dev)
    res.update(copy_bandwidth_GBps=bw, heads=[H, KVH, D], points=[])
    max_model_len = 64 if smoke else 40960
    for s, ctxs in workload_steps(smoke):
        B = bucket(len(ctxs))
        rule = choose_num_splits(B, KVH, max_model_len, tile_n(16), num_sms(dev), D)
        point = {"step": s, "rows": len(ctxs), "bucket": B, "mean_ctx": sum(ctxs) / len(ctxs),
                 "kv_bytes": sum(ctxs) * KVH * D * 2 * 2, "rule_splits": rule, "variants": []}
        for cache, rope in (("bf16", True), ("bf16", False), ("fp8", True)):
            if cache == "fp8" and smoke: continue                          # the interpreter's fp8 is not faithful
            if rope or cache == "fp8":
                c = make_case(dev, ctxs, H, KVH, D, 1 << 20 if smoke else 4 << 30, dtype, seed=s,
                              cache_dtype=torch.float8_e4m3fn if cache == "fp8" else None)
            nbytes = sum(ctxs) * KVH * D * 2 * (1 if cache == "fp8" else 2)
            ref = reference(c, H, KVH, D, rope)
            for splits in sorted({1, 2, 4, 8, 16, rule}):
                out = torch.empty(B, H, D, device=dev, dtype=dtype)
                call(c, 0, splits, rope, out, max_model_len)
                n = len(ctxs)
                err = rel_err(out[:n].float(), ref[:n])
                assert err < (5e-2 if cache == "fp8" else 2e-2), (s, cache, splits, rope, err)
                t, flag = graph_ms([lambda i=i % 2: call(c, i, splits, rope, out, max_model_len)
                                    for i in range(2 if smoke else 16)], dev)
                v = {"cache": cache, "splits": splits, "rope": rope, "rule": splits == rule, "rel_err": err, "ms": t,
                     "disagree": flag, "GBps": nbytes / min(t) / 1e6, "share": nbytes / min(t) / 1e6 / bw}
                point["variants"].append(v)
                print(s, len(ctxs), {k: (round(x, 4) if isinstance(x, float) else x) for k, x in v.items()}, flush=True)
        res["points"].append(point)
        del c, ref
        if dev.type == "cuda": torch.cuda.empty_cache()
    estimate(res)


def estimate(res) -> None:
    "One layer's decode attention over the workload's decode steps: the rule against the best split count a point."
    pts = res["points"]
    total = defaultdict(float)
    for i, p in enumerate(pts):
        span = (pts[i + 1]["step"] if i + 1 < len(pts) else p["step"] + 1) - p["step"]
        for cache, rope in {(v["cache"], v["rope"]) for v in p["variants"]}:
            vs = [v for v in p["variants"] if (v["cache"], v["rope"]) == (cache, rope)]
            name = cache + ("" if rope else " no rope")
            total[name + " rule"] += span * min(next(v for v in vs if v["rule"])["ms"])
            total[name + " best"] += span * min(min(v["ms"]) for v in vs)
            p[name + " best_splits"] = min(vs, key=lambda v: min(v["ms"]))["splits"]
    res["estimate_ms_one_layer"] = total
    print("estimate (ms, one layer, whole run):", {k: round(v, 2) for k, v in total.items()},
          {p["step"]: (p["rows"], p["rule_splits"], p["bf16 best_splits"]) for p in pts}, flush=True)


def main():
    args = parser(__doc__, parts="sweep").parse_args()
    res = {"what": "decode attention alone at nano-vllm's workload's decode steps, by split count"}
    run_parts({"sweep": lambda: sweep(res, args)}, args.parts, saver(NAME, res, args))


if __name__ == "__main__":
    main()

"""The decode-attention kernel at the contexts of nano-vllm's workload: split counts, loads ahead (issues 27, 29).

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/decode_workload_h200.py --out $OUT

In the workload profile (`workload_profile_*.json`) decode attention reads K/V at ~89% of the copy bandwidth over
the whole run, and lower at narrow widths (17-64 rows ~80%, 1-16 ~62%), where the kernel alone over contexts
uniform in 128..1,024 reached 99% at 256 rows (`decode_tiles_h200.json`). This script replays the workload's decode
steps for the kernel alone: nano-vllm's 256 requests (prompt and output uniform in 100..1,024, seed 0); at decode
step `s` the rows are the requests whose output is longer than `s`, padded to the CUDA-graph bucket, each with
`prompt + s + 1` keys. At each sampled step, Qwen3-0.6B's heads (16 / 8 / 128), bf16, block size 16, K/V in a
4 GiB pool through random block tables (2 sets of disjoint blocks, rotated), every variant is checked against the
torch reference and timed as 16 calls in one CUDA graph, twice (>15% apart flagged). `--parts splits`:

- splits 1, 2, 4, 8, 16 (only the splits a context has tiles for run, merged in the kernel, as the engine launches);
- with RoPE and Qwen3's q/k norms inside and this step's key written (the engine's launch) and without (the query
  given, its key already in the cache); and the engine's launch over an fp8 (e4m3) cache (issue 29's bytes halved;
  not under `--smoke`: the interpreter's fp8 is not faithful);
- the package's rule (`choose_num_splits` for the workload's longest context, as `graphs.decode_splits` captures).

`--parts ahead`: the decode loop's loads ahead of their use (`attend_rest`'s `AHEAD`: 0 the control, 1 each
tile's block ids a tile early, 2 its keys and values too) and tiles of 64 and 128 keys, bf16 and fp8 caches, at
the rule's split count, the engine's launch.

`--parts fma`: the products on the CUDA cores in fp32 (`attend_tile`'s FMA: the two query heads of a KV head as two
rows, not padded to the tensor cores' 16), tiles of 32 and 64 keys, 4 and 8 warps, beside the control, both caches
(a first version with 128-key tiles did not finish inside a call's time).

GB/s counts K and V of every context token once. `estimate` sums each variant's time over the workload's decode
steps (each sampled step stands for the steps up to the next), for one layer: the rule's total against the best
split count at each step's width. `--smoke`: a tiny shape on the CPU under the interpreter.
"""
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from decode_tiles_h200 import graph_ms  # noqa: E402
from lab import device_or_skip, is_smoke, nanovllm_requests, parser, rel_err, run_parts, saver, write  # noqa: E402

import torch  # noqa: E402

from nanoserve.attention import (choose_num_splits, decode_attention, decode_attention_ref,  # noqa: E402
                                 rope_cache_ref, tile_n)
from nanoserve.measure import copy_bandwidth_GBps  # noqa: E402
from nanoserve.runtime import num_sms  # noqa: E402

NAME = "decode_workload_h200.json"
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def workload_steps(smoke: bool) -> list[tuple[int, list[int]]]:
    "(decode step, the running rows' context lengths) at the sampled steps of nano-vllm's workload."
    reqs, _ = nanovllm_requests(smoke=smoke)
    lens = [(len(r.prompt_token_ids), r.max_tokens) for r in reqs]
    steps = (2,) if smoke else (0, 150, 300, 450, 600, 700, 800, 880, 940, 980, 1010)
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


def call(c, i, splits, rope: bool, out, max_ctx, ahead: int = 0, tile: int | None = None, fma: bool = False,
         warps: int = 4):
    "The package's launcher on table set `i`: the engine's launch (`rope`) or the query given."
    kw = dict(rope=(c["qkv"], c["cos"], c["sin"], c["slots"][i]), qk_norm=c["norm"]) if rope else {}
    return decode_attention(None if rope else c["q"], c["kc"], c["vc"], c["tables"][i], c["cl"], out.shape[-1] ** -0.5,
                            max_ctx, num_splits=splits, out=out, ahead=ahead, tile=tile, fma=fma, num_warps=warps, **kw)


def groups(part: str, smoke: bool) -> list[dict]:
    """The variants a part times at every step, in groups (cache, rope, ahead, tile) of split counts ("rule": the
    package's). splits: every split count, bf16 with and without RoPE, fp8; ahead: `attend_rest`'s loads ahead (0,
    1, 2) and tiles of 64 and 128 keys over both caches, at the rule's split count."""
    caches = ("bf16",) if smoke else ("bf16", "fp8")          # the interpreter's fp8 is not faithful
    if part == "splits":
        return [dict(cache=c, rope=r, ahead=0, tile=None, splits=(1, "rule") if smoke else (1, 2, 4, 8, 16, "rule"),
                     fma=False, warps=4) for c, r in (("bf16", True), ("bf16", False), ("fp8", True)) if c in caches]
    if part == "fma":          # tiles of 128 keys in fp32 products would need ~256 registers a thread: left out
        return [dict(cache=c, rope=True, ahead=0, tile=t, splits=("rule",), fma=f, warps=w) for c in caches
                for f, t, w in ((False, None, 4),) + tuple((True, t, w) for t in ((16,) if smoke else (32, 64))
                                                           for w in (4, 8))]
    return [dict(cache=c, rope=True, ahead=a, tile=t, splits=("rule",), fma=False, warps=4) for c in caches
            for a in (0, 1, 2) for t in ((16,) if smoke else (64, 128))]


def group_name(g: dict) -> str:
    return (f"{g['cache']}{'' if g['rope'] else ' no rope'}{' fma' if g['fma'] else ''} ahead {g['ahead']} "
            f"tile {g['tile'] or 'rule'}" + (f" warps {g['warps']}" if g["warps"] != 4 else ""))


def sweep(res, args, part: str) -> None:
    smoke, dev = is_smoke(args), device_or_skip(args)
    H, KVH, D = (4, 2, 16) if smoke else (16, 8, 128)
    dtype = torch.float16 if smoke else torch.bfloat16
    bw, _ = copy_bandwidth_GBps(1 << 20 if smoke else 4 << 30, dev)
    out_part = res.setdefault(part, {})
    out_part.update(copy_bandwidth_GBps=bw, heads=[H, KVH, D], points=[])
    max_model_len = 64 if smoke else 40960
    for s, ctxs in workload_steps(smoke):
        B, n = bucket(len(ctxs)), len(ctxs)
        rule = choose_num_splits(B, KVH, max_model_len, tile_n(16), num_sms(dev), D)
        point = {"step": s, "rows": n, "bucket": B, "mean_ctx": sum(ctxs) / n,
                 "kv_bytes": sum(ctxs) * KVH * D * 2 * 2, "rule_splits": rule, "variants": []}
        for cache in dict.fromkeys(g["cache"] for g in groups(part, smoke)):
            c = make_case(dev, ctxs, H, KVH, D, 1 << 20 if smoke else 4 << 30, dtype, seed=s,
                          cache_dtype=torch.float8_e4m3fn if cache == "fp8" else None)
            nbytes = sum(ctxs) * KVH * D * 2 * (1 if cache == "fp8" else 2)
            refs = {}
            for g in [g for g in groups(part, smoke) if g["cache"] == cache]:
                if g["rope"] not in refs: refs[g["rope"]] = reference(c, H, KVH, D, g["rope"])
                for splits in sorted({rule if x == "rule" else x for x in g["splits"]}):
                    out = torch.empty(B, H, D, device=dev, dtype=dtype)
                    run = lambda i: call(c, i, splits, g["rope"], out, max_model_len, g["ahead"], g["tile"], g["fma"],
                                         g["warps"])
                    run(0)
                    err = rel_err(out[:n].float(), refs[g["rope"]][:n])
                    assert err < (5e-2 if cache == "fp8" else 2e-2), (s, group_name(g), splits, err)
                    t, flag = graph_ms([lambda i=i % 2: run(i) for i in range(2 if smoke else 16)], dev)
                    keys = ("cache", "rope", "ahead", "tile", "fma", "warps")
                    v = {"group": group_name(g), **{k: g[k] for k in keys},
                         "splits": splits, "rule": splits == rule, "rel_err": err, "ms": t, "disagree": flag,
                         "GBps": nbytes / min(t) / 1e6, "share": nbytes / min(t) / 1e6 / bw}
                    point["variants"].append(v)
                    print(s, n, {k: (round(x, 4) if isinstance(x, float) else x) for k, x in v.items()}, flush=True)
            del c, refs
            if dev.type == "cuda": torch.cuda.empty_cache()
        out_part["points"].append(point)
        write(NAME, res, args)                                  # each step's rows as they are measured
    estimate(out_part)


def estimate(res) -> None:
    """One layer's decode attention over the workload's decode steps, each group at the rule's split count and at the
    best split count of each step."""
    pts = res["points"]
    total = defaultdict(float)
    for i, p in enumerate(pts):
        span = (pts[i + 1]["step"] if i + 1 < len(pts) else p["step"] + 1) - p["step"]
        for name in dict.fromkeys(v["group"] for v in p["variants"]):
            vs = [v for v in p["variants"] if v["group"] == name]
            total[name + ": rule"] += span * min(next(v for v in vs if v["rule"])["ms"])
            total[name + ": best"] += span * min(min(v["ms"]) for v in vs)
            p.setdefault("best_splits", {})[name] = min(vs, key=lambda v: min(v["ms"]))["splits"]
    res["estimate_ms_one_layer"] = total
    print("estimate (ms, one layer, whole run):", {k: round(v, 2) for k, v in total.items()}, flush=True)


def main():
    args = parser(__doc__, parts="splits,ahead,fma").parse_args()
    res = {"what": "decode attention alone at nano-vllm's workload's decode steps: split counts, loads ahead, tiles"}
    run_parts({p: (lambda p=p: sweep(res, args, p)) for p in ("splits", "ahead", "fma")}, args.parts,
              saver(NAME, res, args))


if __name__ == "__main__":
    main()

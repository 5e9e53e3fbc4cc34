"""The one-byte K/V caches on the H200, fp8 (e4m3) and int8 (a scale a row) (issue: quantization users bring, its K/V
part).

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/kv_fp8_h200.py --out $OUT [--parts check,kernel,quality,workload]
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/kv_fp8_h200.py --out $OUT --parts poisson --name kv_fp8_poisson_h200.json
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/kv_fp8_h200.py --out $OUT --caches fp8,int8 \
        --name kv_int8_h200.json

`--caches`: the one-byte dtypes each part sets against the model's (default both). For int8 the writes' check is exact
(the kernels quantize with the reference's fp32 operations: values and scales equal); the Poisson part gives it the
blocks of the bf16 cache's bytes (a block of int8 keeps 4 bytes of scale a row too).

In the tutorials' order:
- check: the kernels' fp8 writes against torch's rounding of the same fp32 values (`rope_cache` with a real rotation:
  the share of bytes equal; the values copied as they are must all be), decode and prefill attention over an fp8
  cache against the torch reference on the same cache, and an fp32 engine with an fp8 cache through the Triton
  kernels and CUDA graphs against one through the torch reference (the same greedy tokens);
- kernel: decode attention over a bf16 and an fp8 cache of the same contexts (batch 1, 64, 256 at 1,024 tokens;
  Qwen3-0.6B's and Qwen2.5-0.5B's heads), interleaved, each timed twice: us a call and K/V GB/s;
- quality: the trained tiny model in bf16 through the Triton kernels, fp8 cache against the bf16 cache (held-out
  rows, teacher-forced: relative logit error, KL, top-1 agreement, perplexity);
- workload: Qwen3-0.6B (random bf16 weights) on nano-vllm's workload with a bf16 and each one-byte cache (and
  `--workload-variants`: the fp8 cache at 64-key decode tiles), engines in one process with the same number of
  blocks (neither preempts at the default 32,768; `--sequential`, or a card under 120 GB at that default, builds
  one engine at a time), interleaved, fresh requests each round (the same for every engine within a round),
  prefill included: output tokens/s;
- poisson: the benchmark chapter's Poisson workload (0.5B shape, lognormal lengths, 64 requests, 32 slots) at
  `--rate` through `nanoserve.bench.run_benchmark`, with `--blocks` bf16 blocks and twice as many fp8 blocks (the
  same bytes): preemptions, recomputed tokens and throughput.
Writes kv_fp8_h200.json (or `--name`). `--smoke`: the same code on the tiny model on the CPU, interpreted, tiny sizes.
"""
import dataclasses, gc, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, WorkloadSpec, device_or_skip, disagree, free, graph_bench, is_smoke, median,  # noqa: E402
                 nanovllm_requests, parser, random_checkpoint, run_benchmark, run_parts,
                 same_greedy_tokens, saver, sync, tiny_model, warm)

import torch  # noqa: E402

from nanoserve.attention import (decode_attention, decode_attention_ref, prefill_attention,  # noqa: E402
                                 prefill_attention_ref, rope_cache, rope_cache_ref)
from nanoserve.bench import model_limits  # noqa: E402
from nanoserve.model import kv_scales, make_kv_cache, quantize_kv  # noqa: E402

FP8 = torch.float8_e4m3fn
DTYPES = {"fp8": FP8, "int8": torch.int8}


def one_byte(k32, v32, dtype):
    "A one-byte cache (keys, values) holding fp32 `k32`, `v32` [blocks, bs, KVH, D] as the engine's cache would."
    if dtype != torch.int8: return k32.to(dtype), v32.to(dtype)
    kc, vc = make_kv_cache(1, *k32.shape, torch.int8, k32.device)[0]
    for cache, x in ((kc, k32), (vc, v32)):
        values, scales = quantize_kv(x)
        cache.copy_(values); kv_scales(cache).copy_(scales)
    return kc, vc


def _cache(num_blocks, bs, kvh, d, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(num_blocks, bs, kvh, d, generator=g, device=device),
            torch.randn(num_blocks, bs, kvh, d, generator=g, device=device))


def check_kernels(device, smoke: bool, dtype=FP8) -> dict:
    "The writes against torch's rounding; decode and prefill over a one-byte cache against the reference on it."
    H, KVH, D, bs = (4, 2, 16, 4) if smoke else (16, 8, 128, 16)
    T, nb = (5, 16) if smoke else (512, 256)
    g = torch.Generator(device=device).manual_seed(0)
    qkv = 3 * torch.randn(T, (H + 2 * KVH) * D, generator=g, device=device)
    ang = torch.rand(T, D // 2, generator=g, device=device) * 6.28
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)      # [T, D], as the model's table
    slots = torch.randperm(nb * bs, generator=g, device=device)[:T]
    (kc, vc), (kr, vr) = make_kv_cache(2, nb, bs, KVH, D, dtype, device)
    rope_cache(qkv, cos, sin, slots, kc, vc, H, KVH)
    rope_cache_ref(qkv, cos, sin, slots, kr, vr, H, KVH)
    written = lambda c: c.view(torch.uint8).reshape(nb * bs, KVH, D)[slots]       # [T, KVH, D] bytes (int8: strided)
    k_equal = (written(kc) == written(kr)).float().mean().item()
    v_equal = (written(vc) == written(vr)).float().mean().item()
    if dtype == torch.int8: k_equal = min(k_equal, float(torch.equal(kv_scales(kc), kv_scales(kr))))   # and the scales
    # reads: a full fp8 cache, bf16 queries (the interpreter has no bf16: fp32 under --smoke)
    qdt = torch.float32 if smoke else torch.bfloat16
    k32, v32 = _cache(nb, bs, KVH, D, device, 1)
    k8, v8 = one_byte(k32, v32, dtype)
    B, L = (2, 3) if smoke else (64, 32)
    tables = torch.stack([torch.randperm(nb, generator=g, device=device)[:L] for _ in range(B)])
    ctx = torch.randint(1, L * bs + 1, (B,), generator=g, device=device)
    q = torch.randn(B, H, D, generator=g, device=device).to(qdt)
    out = decode_attention(q, k8, v8, tables, ctx, D ** -0.5, int(ctx.max()))
    ref = decode_attention_ref(q.float(), k8, v8, tables, ctx, D ** -0.5)
    dec_err = ((out.float() - ref).norm() / ref.norm()).item()
    n = min(T, L * bs // 2)
    qp = torch.randn(n, H, D, generator=g, device=device).to(qdt)
    cu, start = torch.tensor([0, n], device=device), torch.tensor([L * bs - n], device=device)
    outp = prefill_attention(qp, k8, v8, tables[:1], cu, start, n, D ** -0.5)
    refp = prefill_attention_ref(qp.float(), k8, v8, tables[:1], cu, start, D ** -0.5)
    pre_err = ((outp.float() - refp).norm() / refp.norm()).item()
    res = {"cache": str(dtype).removeprefix("torch."), "heads": [H, KVH, D],
           "rope_cache_k_bytes_equal": k_equal, "rope_cache_v_bytes_equal": v_equal,
           "decode_rel_err": dec_err, "prefill_rel_err": pre_err}
    # (the interpreter rounds some values to fp8 wrongly: --smoke checks that the code runs, not the bytes)
    assert (v_equal == 1.0 and k_equal > 0.999 or smoke) and dec_err < 2e-2 and pre_err < 2e-2, res
    return res


def check_engines(device, smoke: bool, cache="fp8") -> dict:
    "fp32 engines with a one-byte cache: the Triton kernels (and graphs) against the torch reference: greedy tokens."
    num_prompts, max_tokens = (2, 4) if smoke else (8, 40)
    engines = [LLM(tiny_model(), dtype="float32", device=device.type, kv_cache_dtype=cache, num_kv_blocks=512,
                   max_num_seqs=8, attention_backend=backend) for backend in ("triton", "torch")]
    same = same_greedy_tokens(engines, num_prompts, max_tokens)
    del engines; gc.collect()
    assert same or smoke, f"{cache} engines: the Triton kernels' greedy tokens differ from the torch reference's"
    return {"model": "tiny (fp32)", "cache": cache, "prompts": num_prompts, "tokens_each": max_tokens,
            "identical": same}


def part_check(res, args, device, smoke):
    res["check"] = {"kernels": check_kernels(device, smoke, DTYPES[args.caches[0]]),
                    "engines": check_engines(device, smoke, args.caches[0])}
    for c in args.caches[1:]:
        res["check"][c] = {"kernels": check_kernels(device, smoke, DTYPES[c]),
                           "engines": check_engines(device, smoke, c)}
    print(res["check"], flush=True)


def part_kernel(res, args, device, smoke):
    "Decode attention over bf16 and fp8 caches, interleaved, each timed twice."
    rows = []
    shapes = {"tiny": (4, 2, 16)} if smoke else {"qwen3-0.6B": (16, 8, 128), "0.5B": (14, 2, 64)}
    for name, (H, KVH, D) in shapes.items():
        for B in ((2,) if smoke else (1, 64, 256)):
            ctx_len, bs = (24, 4) if smoke else (1024, 16)
            L = ctx_len // bs
            k32, v32 = _cache(B * L, bs, KVH, D, device, 2)
            tables = torch.arange(B * L, device=device).view(B, L)
            ctx = torch.full((B,), ctx_len, device=device)
            q = torch.randn(B, H, D, device=device, dtype=torch.float32 if smoke else torch.bfloat16)
            caches = {"bf16": (k32.to(q.dtype), v32.to(q.dtype)),
                      **{c: one_byte(k32, v32, DTYPES[c]) for c in args.caches}}
            row = {"shape": name, "heads": [H, KVH, D], "batch": B, "context": ctx_len}
            for r in range(2):
                for which in (list(caches) if r == 0 else list(caches)[::-1]):
                    kc, vc = caches[which]
                    nbytes = 2 * kc.untyped_storage().nbytes()
                    warm(device, 0.5)
                    # inside CUDA graphs, over enough copies of the cache to miss L2 (no host launch time)
                    us = graph_bench(lambda i: (lambda: decode_attention(q, kc, vc, tables, ctx, D ** -0.5, ctx_len)),
                                     nbytes, device=device)
                    row.setdefault(which, []).append(median(us))
            for which, (kc, vc) in caches.items():
                nbytes = 2 * B * ctx_len * KVH * (D * kc.element_size() + 4 * (kc.dtype == torch.int8))
                row[which + "_disagree"] = disagree(*row[which])
                row[which + "_GBps"] = nbytes / (median(row[which]) * 1e-6) / 1e9
            for c in args.caches: row[f"{c}_over_bf16"] = median(row[c]) / median(row["bf16"])
            rows.append(row)
            print(row, flush=True)
    res["kernel"] = rows


def part_quality(res, args, device, smoke):
    "The tiny model in bf16 (fp32 under --smoke) through the Triton kernels: fp8 cache against the bf16 cache."
    from quant_quality_cpu import sequence_logits
    from nanoserve.model import load_model
    from nanoserve.quant import logit_quality
    from nanoserve.runner import KernelConfig, model_kernels
    from nanoserve.tokenizer import default_model
    from nanoserve.train import heldout_rows
    dtype = torch.float32 if smoke else torch.bfloat16
    model = load_model(default_model(), dtype=dtype, device=device)          # the trained one, not the smoke model
    model.set_kernels(model_kernels(KernelConfig().resolve(device)))
    rows = heldout_rows(default_model() / "tokenizer.json", num_rows=2 if smoke else 16, seq_len=32 if smoke else 256)
    logits = lambda dt: torch.cat([sequence_logits(model, r[:-1].to(device), cache_dtype=dt) for r in rows]).float()
    ref, targets = logits(None), rows[:, 1:].reshape(-1).to(device)
    qs = {c: logit_quality(ref, logits(DTYPES[c]), targets) for c in args.caches}
    res["quality"] = {"model": f"tiny ({str(dtype).removeprefix('torch.')}, Triton kernels)", "rows": int(rows.shape[0]),
                      "seq_len": int(rows.shape[1] - 1), **qs[args.caches[0]], "by_cache": qs}
    print(res["quality"], flush=True)


WORKLOAD_VARIANTS = {"fp8 tile 64": {"kv_cache_dtype": "fp8", "decode_tile": 64}}   # --workload-variants: lab variants


def part_workload(res, args, device, smoke):
    """Qwen3-0.6B, nano-vllm's workload, the model's cache against each one-byte cache (and `--workload-variants`), the
    same block count, interleaved; `--sequential`: each engine built for its run and dropped after it (a card that
    cannot hold them all at once), warmed on a few requests first."""
    model_dir = tiny_model() if smoke else random_checkpoint("qwen3-0.6B", device=device.type)
    kw = dict(dtype="float32" if smoke else "bfloat16", max_num_seqs=8 if smoke else 256,
              max_num_batched_tokens=256 if smoke else 16384, num_kv_blocks=256 if smoke else args.workload_blocks)
    variants = {"auto": {}, **{c: {"kv_cache_dtype": c} for c in args.caches},
                **{v: WORKLOAD_VARIANTS[v] for v in args.workload_variants}}
    make = lambda v: LLM(model_dir, **kw, **variants[v])
    sequential = args.sequential or (device.type == "cuda" and args.workload_blocks >= 32768
                                     and torch.cuda.get_device_properties(device).total_memory < 120e9)
    if sequential and not args.sequential: print("workload: one engine at a time (this card holds one)", flush=True)
    engines = {} if sequential else {v: make(v) for v in variants}
    vocab, max_len = model_limits(model_dir, {})
    out = {"model": "tiny" if smoke else "qwen3-0.6B", "engine_kwargs": kw, "variants": variants,
           "sequential": sequential, "rounds": [],
           "numerator": "output tokens actually generated (EOS ignored, every request to its max_tokens)"}
    workload = lambda seed: nanovllm_requests(vocab, max_len, smoke=smoke, seed=seed)

    def warm_run(llm, n=None):
        "One untimed run of the first `n` requests (all) of another seed's workload: kernels compiled, graphs replayed."
        reqs, sp = workload(99)
        llm.generate([list(q.prompt_token_ids) for q in reqs[:n]], sp[:n])

    for llm in engines.values(): warm_run(llm)
    for r in range(1 if smoke else args.rounds):
        reqs, sp = workload(100 + r)
        row = {"seed": 100 + r}
        for v in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            llm = engines.get(v) or make(v)
            if v not in engines: warm_run(llm, 16)
            warm(device, 0 if smoke else 3.0)
            sync(device)
            t0 = time.perf_counter()
            outs = llm.generate([list(q.prompt_token_ids) for q in reqs], sp)
            sync(device)
            dt = time.perf_counter() - t0
            n = sum(len(o.token_ids) for o in outs)
            assert n == sum(q.max_tokens for q in reqs)
            row[v] = {"seconds": dt, "output_tokens": n, "output_tokens_per_s": n / dt,
                      "preemptions": sum(o.num_preemptions for o in outs), "num_kv_blocks": llm.num_kv_blocks}
            if v not in engines: del llm; gc.collect(); free()
        for v in list(variants)[1:]:
            row[f"{v}_over_auto"] = row[v]["output_tokens_per_s"] / row["auto"]["output_tokens_per_s"]
        out["rounds"].append(row)
        print(row, flush=True)
    for v in list(variants)[1:]: out[f"{v}_over_auto_median"] = median([r[f"{v}_over_auto"] for r in out["rounds"]])
    res["workload"] = out
    del engines; gc.collect(); free()


def part_poisson(res, args, device, smoke):
    "The Poisson benchmark with a bf16 cache of `--blocks` blocks and an fp8 cache of twice as many (the same bytes)."
    model_dir = tiny_model() if smoke else random_checkpoint("0.5B", device=device.type)
    spec = WorkloadSpec(kind="lognormal", num_requests=6 if smoke else 64, prompt_median=16 if smoke else 256,
                        output_median=4 if smoke else 128, prompt_max=32 if smoke else 1024, output_max=8 if smoke else 512)
    common = dict(dtype="float32" if smoke else "bfloat16", max_num_seqs=4 if smoke else 32,
                  max_num_batched_tokens=256 if smoke else 2048)
    blocks = 8 if smoke else args.blocks
    rows = []
    D = 16 if smoke else 64                                                         # the head size of the model
    same_bytes = {"auto": blocks, "fp8": 2 * blocks, "int8": 2 * blocks * D // (D + 4)}
    for c, nb in ((c, same_bytes[c]) for c in ("auto", *args.caches)):
        kw = common | {"num_kv_blocks": nb} | ({"kv_cache_dtype": c} if c != "auto" else {})
        out = run_benchmark(model_dir, spec, ["continuous"], engine_kwargs=kw, rates=[args.rate], repeats=1 if smoke else 2,
                            warmup_s=0.0 if smoke else 3.0, progress=False, profile_steps=0,
                            limits=model_limits(model_dir, kw))
        for run in out["runs"]:
            for rep in run["reps"]:
                rows.append({"kv_cache_dtype": c, "num_kv_blocks": nb, "rate": run["rate"],
                             "preemptions": rep["preemptions"], "recomputed_tokens": rep["recomputed_tokens"],
                             **{k: rep["summary"][k] for k in ("output_tokens", "output_tokens_per_s", "ttft_p50_s",
                                                               "ttft_p99_s", "tpot_p50_s", "e2e_p99_s")}})
                print(rows[-1], flush=True)
    res["poisson"] = {"spec": dataclasses.asdict(spec), "engine_kwargs": common, "rows": rows}


PARTS = {"check": part_check, "kernel": part_kernel, "quality": part_quality, "workload": part_workload,
         "poisson": part_poisson}


def main():
    ap = parser(__doc__, out="figures/data", parts="check,kernel,quality,workload")
    ap.add_argument("--name", default="kv_fp8_h200.json", help="the data file's name")
    ap.add_argument("--rounds", type=int, default=3, help="workload: interleaved rounds")
    ap.add_argument("--workload-blocks", type=int, default=32768, help="workload: KV blocks of each engine")
    ap.add_argument("--blocks", type=int, default=192, help="poisson: the bf16 cache's blocks (fp8: twice)")
    ap.add_argument("--rate", type=float, default=48.0, help="poisson: requests a second")
    ap.add_argument("--caches", default="fp8,int8", help="the one-byte K/V dtypes set against the model's: fp8, int8")
    ap.add_argument("--workload-variants", default="", help=f"workload: lab variants too, of {list(WORKLOAD_VARIANTS)}")
    ap.add_argument("--sequential", action="store_true", help="workload: one engine on the card at a time")
    args = ap.parse_args()
    args.caches = args.caches.split(",")
    args.workload_variants = [v for v in args.workload_variants.split(",") if v]
    smoke = is_smoke(args)
    device = device_or_skip(args)
    res = {"command": "PYTHONPATH=. python kernels/kv_fp8_h200.py " + " ".join(sys.argv[1:])}
    save = saver(args.name, res, args)
    run_parts({k: (lambda f: lambda: f(res, args, device, smoke))(f) for k, f in PARTS.items()}, args.parts, save)


if __name__ == "__main__":
    main()

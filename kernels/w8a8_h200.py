"""fp8 W8A8 on the H200 (the quantization chapter): checked, then the GEMMs, a prefill chunk and decode steps of the
7B shape timed, bf16 against fp8, in one process.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/w8a8_h200.py --out $OUT [--parts check,gemm,prefill,decode,profile] \
        [--shape 7B] [--chunk 4096] [--batches 1,64,256] [--rounds 3]

In the tutorials' order:
- check: the Triton row quantizer's bytes and scales against torch's (`quantize_rows_fp8_ref`) on random bf16
  activations, `fp8_matmul` against `fp8_matmul_ref` and against the exact bf16 product, per layer of the shape,
  and the fused norm and activation kernels (`add_rmsnorm_fp8`, `silu_mul_fp8`) against the two kernels each replaces;
- gemm: µs a call of each layer at T rows inside CUDA graphs over weight copies that miss L2 (`graph_bench`): bf16
  `F.linear`, the fp8 product with its row quantizer, `torch._scaled_mm` alone, the row quantizer alone, and at one
  row the one-row GEMV over e4m3 weights and input (what an fp8 layer runs there; the speedup's numerator); TFLOP/s;
- prefill: two engines of the shape (bf16 and fp8 weights, random values, the package's defaults otherwise), each
  timing one chunk of `--chunk` fresh random tokens (`max_tokens=1`: the prefill and its first token), timed twice
  per round, the engines alternating and the order flipping each round; TFLOP/s from the model's FLOPs;
- decode: the same engines, ms per step in steady decode at each batch (passes of back-to-back steps, timed twice);
- profile: each engine's device kernels by name over one prefill chunk and over 16 decode steps at the largest batch;
then write (after every part). `--smoke`: the tiny model on the CPU, tiny shapes, a few steps.
"""
import gc, itertools, random, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SamplingParams, device_or_skip, graph_bench, is_smoke, kernel_table, layer_shapes,  # noqa: E402
                 max_rel_err, median, operand_copies, parser, random_checkpoint, random_linear, rel_err, run_parts,
                 saver, steady_decode, step_ms_twice, tiny_model, time_wall, twice, warm)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanoserve.fused import gemv  # noqa: E402
from nanoserve.measure import profile_run  # noqa: E402
from nanoserve.model import SHAPES, ModelConfig  # noqa: E402
from nanoserve.quant import (add_rmsnorm_fp8, fp8_matmul, fp8_matmul_ref, quantize_fp8, quantize_rows_fp8,  # noqa: E402
                             quantize_rows_fp8_ref, silu_mul_fp8)

NAME = "w8a8_h200.json"
SEEDS = itertools.count(1000)                  # a fresh prompt every call: no prefix-cache hit


def layers(args, device, dtype):
    "Each layer of the shape: (name, N, K, bf16 weight, bias or None, e4m3 weight, its scales)."
    for name, N, K, bias in layer_shapes(args.shape, is_smoke(args)):
        w, b = random_linear(N, K, bias, device, dtype)
        yield (name, N, K, w, b) + quantize_fp8(w)


def check(res, args, device, dtype):
    "The row quantizer and the product against their references, per layer."
    rows = []
    for name, N, K, w, b, q, s in layers(args, device, dtype):
        for T in ((1, 8) if is_smoke(args) else (1, 64, args.chunk)):
            x = torch.randn(T, K, device=device, dtype=dtype)
            (xq, xs), (rq, rs) = quantize_rows_fp8(x), quantize_rows_fp8_ref(x)
            out = fp8_matmul(x, q, s, b)
            rows.append({"layer": name, "N": N, "K": K, "T": T, "scales_equal": bool(torch.equal(xs, rs)),
                         "bytes_equal": (xq.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item(),
                         "rel_err_vs_ref": max_rel_err(out, fp8_matmul_ref(x, q, s, b)),
                         "rel_err_vs_bf16": rel_err(out.float(), F.linear(x, w, b).float())})
            if b is not None:                 # can the product add the bias itself (one kernel fewer)?
                try:
                    fused = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), bias=b,
                                             out_dtype=torch.bfloat16 if device.type == "cuda" else dtype)
                    rows[-1]["scaled_mm_bias_rel_err"] = max_rel_err(fused, out)
                except Exception as e:
                    rows[-1]["scaled_mm_bias_error"] = repr(e)[:300]
            print(rows[-1], flush=True)
    res["check"] = {"rows": rows, "fused": fused_checks(args, device, dtype)}
    if not is_smoke(args):
        assert all(r["scales_equal"] and r["bytes_equal"] == 1.0 for r in res["check"]["fused"]), res["check"]["fused"]            # the interpreter rounds some values to e4m3 its own way (the chapter says how)
        assert all(r["scales_equal"] and r["bytes_equal"] == 1.0 and r["rel_err_vs_ref"] < 0.02 for r in rows), rows


def fused_checks(args, device, dtype) -> list:
    "The fused norm and activation kernels' bytes and scales against the two kernels each replaces, run in turn."
    from nanoserve.fused import add_rmsnorm, silu_mul
    cfg = ModelConfig.from_dict(SHAPES[args.shape]) if not is_smoke(args) else None
    H, inter = (cfg.hidden_size, cfg.intermediate_size) if cfg else (256, 688)
    rows = []
    for T in ((1, 8) if is_smoke(args) else (1, 64, args.chunk)):
        x, r = torch.randn(T, H, device=device, dtype=dtype), torch.randn(T, H, device=device, dtype=dtype)
        w = torch.rand(H, device=device, dtype=dtype) + 0.5
        (q, s), _ = add_rmsnorm_fp8(x, r, w, 1e-6)
        q_u, s_u = quantize_rows_fp8(add_rmsnorm(x, r, w, 1e-6)[0])
        gu = torch.randn(T, 2 * inter, device=device, dtype=dtype) * 3
        qa, sa = silu_mul_fp8(gu)
        qa_u, sa_u = quantize_rows_fp8(silu_mul(gu))
        for name, a, b, sa_, sb in (("add_rmsnorm_fp8", q, q_u, s, s_u), ("silu_mul_fp8", qa, qa_u, sa, sa_u)):
            rows.append({"kernel": name, "T": T, "scales_equal": bool(torch.equal(sa_, sb)),
                         "bytes_equal": (a.view(torch.uint8) == b.view(torch.uint8)).float().mean().item()})
    print(rows, flush=True)
    return rows


def gemm(res, args, device, dtype):
    "µs a call and TFLOP/s of each layer at T rows: bf16, fp8 (quantizer + product), the product alone, the quantizer."
    rows = []
    for name, N, K, w, b, q, s in layers(args, device, dtype):
        cb, cf = operand_copies((w, b), 2 * N * K), operand_copies((q, s, b), N * K)
        for T in ((1, 8) if is_smoke(args) else (1, 16, 64, 256, 1024, 4096)):
            x = torch.randn(T, K, device=device, dtype=dtype)
            xq, xs = quantize_rows_fp8(x)
            us = {"bf16": graph_bench(lambda i: lambda: F.linear(x, *cb[i]), 2 * N * K, device=device),
                  "fp8": graph_bench(lambda i: lambda: fp8_matmul(x, *cf[i]), N * K, device=device),
                  "scaled_mm": graph_bench(lambda i: lambda: torch._scaled_mm(
                      xq, cf[i][0].t(), scale_a=xs, scale_b=cf[i][1].view(1, -1),
                      out_dtype=torch.bfloat16 if device.type == "cuda" else dtype), N * K, device=device),
                  "quantize_rows": graph_bench(lambda i: lambda: quantize_rows_fp8(x), 3 * T * K, device=device)}
            if T == 1:                        # what an fp8 layer runs at one row: the GEMV over e4m3 weights and input
                us["fp8_gemv"] = graph_bench(lambda i: lambda: gemv(xq, cf[i][0], cf[i][2], scales=cf[i][1], x_scale=xs,
                                                                    out_dtype=dtype), N * K, device=device)
            flops = 2 * T * N * K
            row = {"layer": name, "N": N, "K": K, "T": T, "us": us,
                   "TFLOPs": {k: flops / min(v) / 1e6 for k, v in us.items() if k != "quantize_rows"},
                   "fp8_speedup": min(us["bf16"]) / min(us["fp8_gemv" if T == 1 else "fp8"])}
            rows.append(row)
            print(name, T, {k: round(min(v), 2) for k, v in us.items()}, f"fp8 {row['fp8_speedup']:.2f}x", flush=True)
    res["gemm"] = {"rows": rows}


def model_flops(cfg: ModelConfig, T: int) -> float:
    "FLOPs of one prefill chunk of T tokens from an empty cache: the projections and causal attention (the LM head's one row aside)."
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    linear = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
    return cfg.num_hidden_layers * (2 * T * linear + 2 * T * T * q)      # QK^T and PV over the causal half: 2 T^2 q


def engines(args, device, dtype, cache={}):
    "The two engines (bf16 and fp8 weights) of the shape, made once."
    if not cache:
        model_dir = tiny_model() if is_smoke(args) else random_checkpoint(args.shape, device=device.type)
        batches = [int(b) for b in args.batches.split(",")]
        for quant in (None, "fp8"):
            cache[quant or "bf16"] = LLM(model_dir, dtype=dtype_name(dtype), device=device.type, quantization=quant,
                                         max_num_seqs=max(batches), max_num_batched_tokens=max(args.chunk, 4096),
                                         num_kv_blocks=512 if is_smoke(args) else args.kv_blocks)
            print(cache[quant or "bf16"], flush=True)
    return cache


def dtype_name(dtype) -> str: return str(dtype).removeprefix("torch.")


def prefill_ms(llm, tokens: int, seed: int) -> float:
    "ms for one fresh prompt of `tokens` random tokens through the engine with `max_tokens=1` (its prefill)."
    g = random.Random(seed)
    prompt = [g.randrange(llm.config.vocab_size) for _ in range(tokens)]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    return median(time_wall(lambda: llm.generate([prompt], sp), reps=1, warmup=0, device=llm.device)) * 1e3


def prefill(res, args, device, dtype):
    "The chunk's ms and TFLOP/s on both engines, interleaved; fresh prompts every time (no prefix-cache hit)."
    es, chunk = engines(args, device, dtype), 64 if is_smoke(args) else args.chunk
    flops = model_flops(es["bf16"].config, chunk)
    ms = {k: [] for k in es}
    for k in es: prefill_ms(es[k], chunk, next(SEEDS))                              # compile, pick algorithms
    for r in range(1 if is_smoke(args) else args.rounds):
        for k in (list(es) if r % 2 == 0 else list(es)[::-1]):
            warm(device, 1.0)
            first, second, disagree = twice(lambda: prefill_ms(es[k], chunk, next(SEEDS)))
            ms[k].append({"ms": [first, second], "disagree": disagree})
            print("prefill", r, k, round(first, 3), round(second, 3), flush=True)
    med = {k: median([x for row in v for x in row["ms"]]) for k, v in ms.items()}
    res["prefill"] = {"tokens": chunk, "flops": flops, "ms": ms, "median_ms": med,
                      "TFLOPs": {k: flops / v / 1e9 for k, v in med.items()}, "fp8_speedup": med["bf16"] / med["fp8"]}
    print(res["prefill"]["TFLOPs"], f"fp8 {res['prefill']['fp8_speedup']:.2f}x", flush=True)


def decode(res, args, device, dtype):
    "ms per step at each batch on both engines, interleaved, the order flipping each round."
    es = engines(args, device, dtype)
    batches = (1, 4) if is_smoke(args) else tuple(int(b) for b in args.batches.split(","))
    steps, rounds = (3, 1) if is_smoke(args) else (args.steps, args.rounds)
    ms = {b: {k: [] for k in es} for b in batches}
    for r in range(rounds):
        for b in batches:
            for k in (list(es) if r % 2 == 0 else list(es)[::-1]):
                first, second, disagree = step_ms_twice(es[k], b, steps, prompt_len=args.prompt_len)
                ms[b][k].append({"ms": [first, second], "disagree": disagree})
                print("decode", r, b, k, round(first, 4), round(second, 4), flush=True)
    summary = {}
    for b in batches:
        med = {k: median([x for row in v for x in row["ms"]]) for k, v in ms[b].items()}
        summary[b] = {"median_ms": med, "fp8_speedup": med["bf16"] / med["fp8"]}
    res["decode"] = {"steps": steps, "rounds": rounds, "prompt_len": args.prompt_len, "ms_per_step": ms,
                     "summary": summary}
    print(summary, flush=True)


def profile(res, args, device, dtype):
    "Where each engine's time goes: one prefill chunk, then 16 decode steps at the largest batch, by kernel."
    es, chunk = engines(args, device, dtype), 64 if is_smoke(args) else args.chunk
    batch, out = max(int(b) for b in args.batches.split(",")), {}
    for k, llm in es.items():
        for i in list(llm._requests): llm.abort_request(i)                           # the decode part's rows
        prefill_ms(llm, chunk, next(SEEDS))
        with profile_run(llm.device) as run: prefill_ms(llm, chunk, next(SEEDS))
        out[k] = {"prefill": kernel_table(run)}
        steady_decode(llm, 4 if is_smoke(args) else batch, args.prompt_len)
        for _ in range(4): llm.step()
        with profile_run(llm.device) as run:
            for _ in range(16): llm.step()
        out[k]["decode"] = kernel_table(run, calls=16)
        print("profile", k, {p: round(v["total_us"]) for p, v in out[k].items()}, flush=True)
        for p, v in out[k].items():
            for name, r in list(v["by_name"].items())[:12]: print(f"  {k} {p} {r['us']:9.1f} us x{r['count']:.0f} {name}")
    res["profile"] = {"batch": batch, "chunk": chunk, **out}


def main():
    ap = parser(__doc__, out="figures/data", parts="check,gemm,prefill,decode,profile")
    ap.add_argument("--shape", default="7B")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--kv-blocks", type=int, default=16384)
    ap.add_argument("--name", default=NAME)
    args = ap.parse_args()
    device = device_or_skip(args)
    dtype = torch.float32 if is_smoke(args) else torch.bfloat16
    res = {"shape": "tiny" if is_smoke(args) else args.shape}
    parts = {p: (lambda p=p: globals()[p](res, args, device, dtype)) for p in ("check", "gemm", "prefill", "decode", "profile")}
    run_parts(parts, args.parts, saver(args.name, res, args))
    gc.collect()
    if any(k.endswith("_error") for k in res): raise SystemExit("a part failed (its error is in the JSON)")


if __name__ == "__main__":
    main()

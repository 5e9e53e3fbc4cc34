"""Weight-only quantization on the GPU (issue: weight-only quantization).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/quant_h200.py --out $OUT
Writes quant_h200.json (raw numbers, git sha, GPU, versions, date) to --out; copy it to figures/data/.

With random weights of the Qwen2.5 shapes (BRIEF.md), in bf16:
1. correctness: both Triton paths (split-K GEMV and tiled GEMM), INT8 and INT4 (group 128), against the
   reference (dequantize to fp32, then matmul in fp32) on every linear layer shape of the 0.5B and 7B models,
   with the QKV bias; max relative error; and one CUDA-graph capture + replay of each path;
2. per-layer microbenchmark: each linear at T = 1, 8, 32, 512 rows for bf16 (`F.linear`), INT8 and INT4, timed
   with `triton.testing.do_bench` (median, L2 flushed between repetitions) twice, >15% disagreement flagged;
   achieved GB/s (weight bytes of the format / time) against the copy bandwidth measured in the same run;
3. engine decode step: `LLM(..., quantization=q)` for q in (None, "int8", "int4"), 0.5B and 7B shapes, ms per
   decode-only `LLM.step()` at batch 1, 8, 32 (CUDA graphs + fused kernels, the engine's GPU defaults; warm-up
   before every row, timed twice), the model's weight bytes and the engine's KV block count;
4. KV sizing: the number of KV blocks the engine sizes by itself (gpu_memory_utilization 0.9) for each q.
Each part is guarded: an error is recorded in the JSON and the next part runs. The whole run aims at < 5 min;
parts are skipped (and marked so) when the time budget runs out.
"""
import argparse, gc, json, os, random, shutil, sys, tempfile, time, traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve.bench import SHAPES, run_meta
from nanoserve.measure import time_twice, warm_gpu
from nanoserve.quant import (QuantLinear, quant_gemm, quant_gemv, quant_matmul, quant_matmul_ref, quantize_int4,
                             quantize_int8, weight_bytes)

DISAGREE = 0.15
GROUP = 128
T0 = time.perf_counter()
BUDGET_S = 285.0


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def layer_shapes(shape):
    "(name, N out, K in, has bias) of one decoder layer's linear layers."
    c = SHAPES[shape]
    h, inter, heads, kvh = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    return [("qkv_proj", (heads + 2 * kvh) * d, h, True), ("o_proj", h, heads * d, False),
            ("gate_up_proj", 2 * inter, h, False), ("down_proj", h, inter, False)]


def make_layer(N, K, bias, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 if bias else None
    return w, b


def packed(w, method):
    return quantize_int8(w) + (None,) if method == "int8" else quantize_int4(w, GROUP)


def rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def copy_bandwidth_GBps(nbytes=1 << 30):
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda"); y = torch.empty_like(x)
    t = time_twice(lambda: y.copy_(x), warmup_s=1.0, repeats=10)
    del x, y; torch.cuda.empty_cache()
    return 2 * nbytes / (t.median_ms / 1e3) / 1e9, t.disagree


# -- 1. correctness ------------------------------------------------------------------------------------------------

def correctness(res):
    rows = []
    for shape in ("0.5B", "7B"):
        for name, N, K, has_bias in layer_shapes(shape):
            w, b = make_layer(N, K, has_bias)
            for method in ("int8", "int4"):
                p = packed(w, method)
                g = torch.Generator(device="cuda").manual_seed(1)
                for T in (1, 8, 16, 32, 33, 512):
                    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g)
                    ref = quant_matmul_ref(x.float(), *p, b, method, GROUP)               # fp32 reference
                    ref_bf16 = quant_matmul_ref(x, *p, b, method, GROUP)                   # the torch path in bf16
                    row = {"shape": shape, "layer": name, "N": N, "K": K, "method": method, "T": T,
                           "auto": rel_err(quant_matmul(x, *p, b, method, GROUP), ref),
                           "torch_bf16_path": rel_err(ref_bf16, ref)}
                    if T <= 32: row["gemv"] = rel_err(quant_gemv(x, *p, b, method, GROUP), ref)
                    row["gemm"] = rel_err(quant_gemm(x, *p, b, method, GROUP), ref)
                    rows.append(row)
                del p
            del w, b; torch.cuda.empty_cache()
            worst = max(max(r.get("gemv", 0), r["gemm"], r["auto"]) for r in rows if r["shape"] == shape and r["layer"] == name)
            log("correctness", shape, name, f"max rel err {worst:.2e}")
    res["correctness"] = {"reference": "dequantize to fp32, fp32 matmul (x rounded to bf16 first)",
                          "max_rel_err": max(max(r.get("gemv", 0), r["gemm"], r["auto"]) for r in rows), "rows": rows}
    # CUDA graphs: capture each path once and replay it on new inputs
    graph = {}
    w, b = make_layer(1152, 896, True)
    for method in ("int8", "int4"):
        p = packed(w, method)
        for T in (1, 64):
            x = torch.randn(T, 896, device="cuda", dtype=torch.bfloat16)
            quant_matmul(x, *p, b, method, GROUP)                                        # compile outside capture
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr): out = quant_matmul(x, *p, b, method, GROUP)
            x.copy_(torch.randn_like(x)); gr.replay(); torch.cuda.synchronize()
            graph[f"{method} T={T}"] = rel_err(out, quant_matmul_ref(x.float(), *p, b, method, GROUP))
    res["correctness"]["cuda_graph_replay_rel_err"] = graph
    log("graph replay", graph)


# -- 2. per-layer microbenchmark -----------------------------------------------------------------------------------

def bench_twice(fn):
    import triton.testing
    a = triton.testing.do_bench(fn, warmup=25, rep=80, return_mode="median")
    b = triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median")
    return a, b, abs(a - b) / min(a, b) > DISAGREE


def microbench(res, shapes=("0.5B", "7B"), Ts=(1, 8, 32, 512)):
    bw, dis = copy_bandwidth_GBps()
    res["copy_bandwidth_GBps"], res["copy_bandwidth_disagree"] = bw, dis
    log(f"copy bandwidth {bw:.0f} GB/s")
    rows = []
    for shape in shapes:
        for name, N, K, has_bias in layer_shapes(shape):
            w, b = make_layer(N, K, has_bias)
            mods = {"bf16": None}
            for method in ("int8", "int4"):
                mods[method] = QuantLinear(*packed(w, method), b, K, N, method, GROUP if method == "int4" else None)
            warm_gpu(1.0)
            for T in Ts:
                x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
                for fmt, mod in mods.items():
                    fn = (lambda: F.linear(x, w, b)) if mod is None else (lambda m=mod: m(x))
                    nbytes = 2 * N * K if mod is None else weight_bytes(mod) - (0 if b is None else 2 * N)
                    t1, t2, disagree = bench_twice(fn)
                    ms = min(t1, t2)
                    rows.append({"shape": shape, "layer": name, "N": N, "K": K, "T": T, "format": fmt,
                                 "ms": [t1, t2], "disagree": disagree, "weight_bytes": nbytes,
                                 "GBps": nbytes / (ms / 1e3) / 1e9, "of_copy_bw": nbytes / (ms / 1e3) / 1e9 / bw,
                                 "path": None if mod is None else ("gemv" if T <= 32 else "gemm")})
                line = {r["format"]: f"{r['ms'][0] * 1e3:.1f}us {r['GBps']:.0f}GB/s" for r in rows[-3:]}
                log("layer", shape, name, f"T={T}", line)
            del mods, w, b; torch.cuda.empty_cache()
    res["microbench"] = {"timer": "triton.testing.do_bench median, L2 flushed, twice", "group_size": GROUP, "rows": rows}


# -- 3. engine decode step -----------------------------------------------------------------------------------------

def fast_random_checkpoint(shape):
    "A config-only folder; the loader is pointed at random tensors made on the GPU (a 7B safetensors file is 15 GB)."
    import nanoserve.model as M
    from nanoserve.tokenizer import ensure_default_model, qwen2_weight_shapes
    d = Path(tempfile.mkdtemp())
    cfg = {"model_type": "qwen2", **SHAPES[shape], "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "dtype": "bfloat16", "rope_theta": 1e6, "use_sliding_window": False}
    (d / "config.json").write_text(json.dumps(cfg))
    for f in ensure_default_model().iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json": shutil.copy(f, d / f.name)
    real = M.load_state_dict
    def fake(model_dir, device="cpu"):
        if Path(model_dir) != d: return real(model_dir, device)
        gen = torch.Generator(device="cuda").manual_seed(0)
        return {n: torch.ones(s, device="cuda", dtype=torch.bfloat16) if n.endswith("norm.weight") else
                torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                for n, s in qwen2_weight_shapes(cfg).items()}
    M.load_state_dict = fake
    return d


def steady_decode(llm, batch, prompt_len=128, seed=0):
    "Abort everything, add `batch` requests and run their prefill: decode-only steps from here."
    from nanoserve.engine import SamplingParams
    for i in list(llm._requests): llm.abort_request(i)
    g = random.Random(seed)
    for _ in range(batch):
        llm.add_request([g.randrange(llm.config.vocab_size) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=min(4000, llm.max_model_len - prompt_len), temperature=0,
                                       ignore_eos=True), stream=False)
    while any(r.seq.num_computed_tokens < r.seq.num_prompt_tokens for r in llm._requests.values()): llm.step()


def free(llm):
    for i in list(llm._requests): llm.abort_request(i)
    del llm; gc.collect(); torch.cuda.empty_cache()


def engine_decode(res, shape, model_dir, batches=(1, 8, 32), num_kv_blocks=2048, repeats=20):
    from nanoserve.engine import LLM
    for q in (None, "int8", "int4"):
        if time.perf_counter() - T0 > BUDGET_S:
            res.setdefault("skipped", []).append(f"decode {shape} {q}"); continue
        key = f"{shape} {q or 'bf16'}"
        try:
            t0 = time.perf_counter()
            kw = {} if q is None else {"quantization": q, "quant_group_size": GROUP}
            llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=num_kv_blocks, max_num_seqs=max(batches),
                      max_num_batched_tokens=2048, **kw)
            row = {"shape": shape, "quantization": q, "group_size": GROUP if q == "int4" else None,
                   "weight_bytes": weight_bytes(llm.model), "num_kv_blocks": llm.num_kv_blocks,
                   "quant_report": repr(getattr(llm, "quant_report", None)), "init_s": time.perf_counter() - t0,
                   "batches": []}
            for b in batches:
                steady_decode(llm, b)
                warm_gpu(1.0, llm.device)
                t = time_twice(llm.step, warmup_s=0.3, repeats=repeats)
                row["batches"].append({"batch": b, "ms_per_step": [t.first_ms, t.second_ms], "median_ms": t.median_ms,
                                       "disagree": t.disagree, "tokens_per_s": b / (t.median_ms / 1e3)})
                log("decode", key, f"batch {b}: {t.median_ms:.3f} ms/step", "DISAGREE" if t.disagree else "")
            free(llm)
        except Exception as e:
            traceback.print_exc(); row = {"shape": shape, "quantization": q, "error": repr(e)}
            gc.collect(); torch.cuda.empty_cache()
        res.setdefault("decode", []).append(row)
    base = {r["shape"]: r for r in res.get("decode", []) if r.get("quantization") is None and "batches" in r}
    for r in res.get("decode", []):
        if "batches" in r and r["shape"] in base:
            for rb, bb in zip(r["batches"], base[r["shape"]]["batches"]):
                rb["speedup_vs_bf16"] = bb["median_ms"] / rb["median_ms"]


def kv_sizing(res, shape, model_dir):
    "KV blocks the engine sizes by itself (eager, to skip graph capture) for each quantization."
    from nanoserve.engine import LLM
    for q in (None, "int8", "int4"):
        if time.perf_counter() - T0 > BUDGET_S:
            res.setdefault("skipped", []).append(f"kv {shape} {q}"); continue
        try:
            kw = {} if q is None else {"quantization": q, "quant_group_size": GROUP}
            llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=32, enforce_eager=True, gpu_memory_utilization=0.9, **kw)
            row = {"shape": shape, "quantization": q, "weight_bytes": weight_bytes(llm.model),
                   "num_kv_blocks": llm.num_kv_blocks, "block_size": llm.block_size}
            free(llm)
        except Exception as e:
            traceback.print_exc(); row = {"shape": shape, "quantization": q, "error": repr(e)}
            gc.collect(); torch.cuda.empty_cache()
        log("kv sizing", row)
        res.setdefault("kv_sizing", []).append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="correctness,microbench,decode7b,decode05,kv")
    args = ap.parse_args()
    res = {"meta": run_meta(), "command": "PYTHONPATH=. python kernels/quant_h200.py --out $OUT", "dtype": "bfloat16",
           "group_size": GROUP}
    out = Path(args.out) / "quant_h200.json"
    dirs = {}
    def model_dir(shape):
        if shape not in dirs: dirs[shape] = fast_random_checkpoint(shape)
        return dirs[shape]
    parts = {"correctness": lambda: correctness(res), "microbench": lambda: microbench(res),
             "decode05": lambda: engine_decode(res, "0.5B", model_dir("0.5B")),
             "decode7b": lambda: engine_decode(res, "7B", model_dir("7B"), num_kv_blocks=1024, repeats=15),
             "kv": lambda: (kv_sizing(res, "0.5B", model_dir("0.5B")), kv_sizing(res, "7B", model_dir("7B")))}
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        if t0 - T0 > BUDGET_S:
            res.setdefault("skipped", []).append(name); log("skipped", name); continue
        try: parts[name]()
        except Exception as e:
            traceback.print_exc(); res[f"{name}_error"] = repr(e)
        res.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
        log(f"part {name}: {time.perf_counter() - t0:.0f} s")
        out.write_text(json.dumps(res, indent=1))
    res["total_seconds"] = time.perf_counter() - T0
    out.write_text(json.dumps(res, indent=1))
    log("wrote", out)


if __name__ == "__main__":
    main()

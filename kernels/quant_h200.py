"""H200 measurements for the weight-only quantization chapter (nbs/08_quant.ipynb): kernel correctness, a GEMV
configuration sweep, prefill GEMMs, the engine's decode step and KV sizing, with random weights (no checkpoint).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/quant_h200.py --out $OUT
Writes quant_h200.json (raw numbers, git sha, GPU, versions, date) to --out after EVERY part (a run cut off early
still leaves data); copy it to figures/data/. The whole run aims at < 160 s (Triton compiles, ~0.5-1 s each, are
most of it); a part that starts past BUDGET_S is skipped and marked so. In bf16, INT4 group 128:

a. correctness, 7B layer shapes (qkv/o/gate_up/down), INT8 + INT4, T in (1, 4, 16, 512): max relative error vs the
   reference (dequantize to fp32, fp32 matmul) of the FMA GEMV (T <= 4), the tensor-core path with split-K
   (`quant_gemm`, every T: at 4 and 16 rows it is the old split-K tl.dot GEMV, at 512 the tiled GEMM) and the
   dispatch (`quant_matmul`), and at one row the kernels' options, each over the tuned table (`OPTIONS`: INT4
   with the zero point inside the pairs, with lanes by shift, on the tensor cores; INT8 in fp16 pairs); one
   CUDA-graph capture + replay of each path;
b. GEMV sweep at T = 1 on the 7B shapes (no bias): the package's rule first, then BLOCK_N x BLOCK_K x num_warps
   candidates (INT4 also with the first version's interleaved nibbles, PAIRS=False; methods interleaved, stops
   after SWEEP_S seconds), each timed by graph_bench (kernels/graphs_h200.py: calls over enough weight copies to
   defeat L2, captured in one CUDA graph and replayed; an earlier version used do_bench, whose per-call host
   launch time swamped these 10-50 us kernels), GB/s of the format's bytes against bf16 F.linear and the copy bandwidth of the same run; then the
   best's tiles with SPLIT_K 1, 2, 4 and 8. The best per (method, layer) goes into
   nanoserve.quant.GEMV_OVERRIDES, so part d runs with it, and is recorded ("chosen");
c. GEMM at T = 512 for gate_up and down: bf16 F.linear, INT8, INT4 (do_bench);
d. engine decode step: LLM(..., quantization=q) for q in (None, "int8", "int4"), 7B shape at batch 1, 8, 32, then
   0.5B at batch 1, 8: ms per decode-only LLM.step() (CUDA graphs, async scheduling: the engine's GPU defaults),
   two passes of STEPS back-to-back steps with one sync each after a warm-up pass and warm_gpu(0.5 s), the faster
   pass kept and >15% disagreement flagged; every LLM is deleted (gc + empty_cache) before the next;
e. KV sizing: 0.5B shape, gpu_memory_utilization 0.9, enforce_eager: weight bytes and num_kv_blocks per q.
Each part is guarded: an error is recorded in the JSON and the next part runs.
"""
import argparse, gc, json, os, sys, time, traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve.bench import SHAPES, run_meta

from graphs_h200 import fast_random_checkpoint, steady_decode   # kernels/ is on sys.path when run as a script
from graphs_h200 import operand_copies as copies
from nanoserve.measure import time_twice, warm_gpu
import nanoserve.quant as Q
from nanoserve.quant import (GEMV_OVERRIDES, gemm_config, gemv_config, quant_gemm, quant_gemv, quant_matmul,
                             quant_matmul_ref, quantize_int4, quantize_int8, weight_bytes)

GROUP = 128
T0 = time.perf_counter()
BUDGET_S = 290.0           # no part (and no engine) starts after this; KV sizing (small, eager) gets 10 s more
STEPS = 100                # decode steps per timed pass
SWEEP_S = 70.0             # the GEMV sweep's own budget (compiles dominate)
METHODS = ("int8", "int4")


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def over(limit=BUDGET_S):
    return time.perf_counter() - T0 > limit


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


def packed(w, method, rows: bool = False):
    "`w` quantized, in the layout `QuantLinear` stores (INT4: tiled where `gemv_tile` says; `rows`: row-major)."
    if method == "int8": return quantize_int8(w) + (None,)
    tile = 0 if rows else Q.gemv_tile(w.shape[0], w.shape[1], GROUP)
    return Q.tile_int4(*quantize_int4(w, GROUP), GROUP, tile) if tile else quantize_int4(w, GROUP)


def fmt_bytes(p):
    return sum(t.numel() * t.element_size() for t in p if t is not None)


def rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def bench(fn, rep=20):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def gbench(make_call, nbytes):
    "ms per call, the faster of two passes of graph_bench (kernels/graphs_h200.py): as a decode step's graph sees it."
    from graphs_h200 import graph_bench
    return min(graph_bench(make_call, nbytes)) / 1e3


def gbps(nbytes, ms):
    return nbytes / (ms / 1e3) / 1e9


def copy_bandwidth_GBps(nbytes=1 << 30):
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda"); y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep=50)
    del x, y; torch.cuda.empty_cache()
    return 2 * nbytes / (ms / 1e3) / 1e9


def cleanup():
    gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()


# -- a. correctness ------------------------------------------------------------------------------------------------

OPTIONS = {"int4": {"gemv_zpair": {"ZPAIR": True}, "gemv_zpair_shift": {"ZPAIR": True, "SHIFT": True},
                    "gemv_dot": {"DOT": True, "BLOCK_N": 64, "num_warps": 4}},
           "int8": {"gemv_f16": {"F16": True}, "gemv_f16_64x128": {"F16": True, "BLOCK_N": 64, "BLOCK_K": 128,
                                                                  "num_warps": 4, "SPLIT_K": None}}}
# the one-row options, each over the tuned table (which now holds `ZPAIR` + `SHIFT` and `F16` for the 7B layers)


def correctness(res):
    rows = []
    res["correctness"] = {"reference": "dequantize to fp32, fp32 matmul (x rounded to bf16 first)", "rows": rows}
    for name, N, K, has_bias in layer_shapes("7B"):
        w, b = make_layer(N, K, has_bias)
        for method in METHODS:
            p = packed(w, method)
            g = torch.Generator(device="cuda").manual_seed(1)
            for T in (1, 4, 16, 512):
                x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g)
                ref = quant_matmul_ref(x.float(), *p, b, method, GROUP)                   # fp32 reference
                row = {"layer": name, "N": N, "K": K, "method": method, "T": T,
                       "auto": rel_err(quant_matmul(x, *p, b, method, GROUP), ref),
                       "torch_bf16_path": rel_err(quant_matmul_ref(x, *p, b, method, GROUP), ref)}
                if method == "int4":                        # the row-major layout too
                    row["auto_rows"] = rel_err(quant_matmul(x, *packed(w, method, rows=True), b, method, GROUP), ref)
                    row["tile"] = Q.weight_layout(p[0])[0]
                if T <= Q.GEMV_MAX_T: row["gemv_fma"] = rel_err(quant_gemv(x, *p, b, method, GROUP), ref)
                if T == 1:                                  # the untimed options of the one-row paths
                    for opt, cfg in OPTIONS[method].items():
                        row[opt] = rel_err(quant_gemv(x, *p, b, method, GROUP, config=cfg), ref)
                if T > 1: row["gemm_splitk_dot"] = rel_err(quant_gemm(x, *p, b, method, GROUP), ref)
                rows.append(row)
                del x, ref
            del p
        del w, b; cleanup()
        worst = max(max(v for k, v in r.items() if k in ("auto", "auto_rows", "gemv_fma", "gemm_splitk_dot"))
                    for r in rows if r["layer"] == name)
        log("correctness 7B", name, f"max rel err {worst:.2e}")
    res["correctness"]["max_rel_err"] = max(max(v for k, v in r.items() if k in ("auto", "auto_rows", "gemv_fma",
                                                                                     "gemm_splitk_dot"))
                                            for r in rows)
    res["correctness"]["options_max_rel_err"] = {o: max(r[o] for r in rows if o in r)
                                                 for m in OPTIONS for o in OPTIONS[m]}
    log("correctness of the options", res["correctness"]["options_max_rel_err"])
    graph = {}                                  # CUDA graphs: capture each path once, replay on new inputs
    w, b = make_layer(4608, 3584, True)
    for method in METHODS:
        p = packed(w, method)
        for T in (1, 16):
            x = torch.randn(T, 3584, device="cuda", dtype=torch.bfloat16)
            quant_matmul(x, *p, b, method, GROUP)                                         # compiled outside capture
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr): out = quant_matmul(x, *p, b, method, GROUP)
            x.copy_(torch.randn_like(x)); gr.replay(); torch.cuda.synchronize()
            graph[f"{method} T={T}"] = rel_err(out, quant_matmul_ref(x.float(), *p, b, method, GROUP))
            del gr, out
    del w, b, p; cleanup()
    res["correctness"]["cuda_graph_replay_rel_err"] = graph
    log("graph replay", graph)


# -- b. GEMV sweep -------------------------------------------------------------------------------------------------

def candidates(method):
    "The package's rule first ({}: no override), then one change at a time, then combinations."
    bk = [128, 256, 512] if method == "int8" else [256, 512, 1024]
    base = {k: v for k, v in gemv_config(1, 3584, 3584, method, GROUP, 132).items() if k in ("BLOCK_N", "BLOCK_K", "num_warps")}
    out, seen = [{}], [base]
    def add(c):
        if c not in seen: seen.append(c); out.append(c)
    for n in (16, 64): add({**base, "BLOCK_N": n})
    for k in bk: add({**base, "BLOCK_K": k})
    add({**base, "num_warps": 8})
    for n in (16, 32, 64):
        for k in bk:
            for nw in (4, 8): add({"BLOCK_N": n, "BLOCK_K": k, "num_warps": nw})
    if method == "int4":                         # the first version's interleaved nibbles, for the same tiles
        for c in list(out[1:7]): add({**c, "PAIRS": False})
    return out


def sweep(res):
    sec = res["gemv_sweep"] = {"T": 1, "timer": "graph_bench: CUDA graph of calls over rotating weight copies (>= 256 MB), faster of two passes",
                               "group_size": GROUP, "rows": [], "chosen": {}, "bf16": {}}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth_GBps()
    sec["copy_bandwidth_GBps"] = res["copy_bandwidth_GBps"] = bw
    log(f"copy bandwidth {bw:.0f} GB/s")
    layers = {}
    for name, N, K, _ in layer_shapes("7B"):
        w, _b = make_layer(N, K, False)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ws = copies((w,), 2 * N * K)
        ms = gbench(lambda i: (lambda: F.linear(x, ws[i][0])), 2 * N * K)
        sec["bf16"][name] = {"ms": ms, "GBps": gbps(2 * N * K, ms)}
        layers[name] = (N, K, x, {m: copies(packed(w, m), fmt_bytes(packed(w, m))) for m in METHODS})
        del w, ws
    log("bf16 T=1", {k: f"{v['ms'] * 1e3:.1f}us {v['GBps']:.0f}GB/s" for k, v in sec["bf16"].items()})
    GEMV_OVERRIDES.clear()                                     # the rule first, then the candidates
    best = {}                                                  # (method, layer) -> (ms, config)
    cands = {m: candidates(m) for m in METHODS}
    t_start = time.perf_counter()
    for i in range(max(len(c) for c in cands.values())):
        for method in METHODS:
            if i >= len(cands[method]) or time.perf_counter() - t_start > SWEEP_S: continue
            cfg = cands[method][i]
            for name, (N, K, x, p) in layers.items():
                try:
                    full = {k: v for k, v in gemv_config(1, N, K, method, GROUP, sms, cfg).items() if k != "SUB_K"}
                    ms = gbench(lambda j: (lambda: quant_gemv(x, *p[method][j], None, method, GROUP, config=cfg)),
                                fmt_bytes(p[method][0]))
                    row = {"method": method, "layer": name, **full, "ms": ms,
                           "GBps": gbps(fmt_bytes(p[method][0]), ms), "rule": i == 0}
                    row["of_copy_bw"], row["vs_bf16"] = row["GBps"] / bw, sec["bf16"][name]["ms"] / ms
                except Exception as e:
                    row = {"method": method, "layer": name, **cfg, "error": repr(e)[:300]}
                sec["rows"].append(row)
                if "ms" in row and ((method, name) not in best or row["ms"] < best[(method, name)][0]):
                    best[(method, name)] = (row["ms"], {k: full[k] for k in ("BLOCK_N", "BLOCK_K", "num_warps",
                                                                             "num_stages", "PAIRS", "SPLIT_K")})
            log("sweep", method, cfg or "rule", {r["layer"]: f"{r['ms'] * 1e3:.1f}us {r['GBps']:.0f}GB/s"
                                       for r in sec["rows"][-4:] if "ms" in r})
    sec["configs_tried"] = {m: sum(1 for r in sec["rows"] if r["method"] == m) // 4 for m in METHODS}
    for (method, name), (ms, cfg) in list(best.items()):    # the winner's tiles with other split counts
        N, K, x, p = layers[name]
        for sk in (1, 2, 4, 8):
            if sk == cfg["SPLIT_K"] or over(): continue
            c1 = {**cfg, "SPLIT_K": sk}
            ms1 = gbench(lambda j: (lambda: quant_gemv(x, *p[method][j], None, method, GROUP, config=c1)),
                         fmt_bytes(p[method][0]))
            c1["SPLIT_K"] = gemv_config(1, N, K, method, GROUP, sms, c1)["SPLIT_K"]   # after clamping
            sec["rows"].append({"method": method, "layer": name, **c1, "ms": ms1,
                                "GBps": gbps(fmt_bytes(p[method][0]), ms1), "rule": False})
            if ms1 < best[(method, name)][0]: best[(method, name)] = (ms1, c1)
    for (method, name), (ms, cfg) in best.items():
        N, K, x, p = layers[name]
        rule_ms = next((r["ms"] for r in sec["rows"] if r["method"] == method and r["layer"] == name and r.get("rule")
                        and "ms" in r), float("nan"))
        GEMV_OVERRIDES[(method, N, K)] = dict(cfg)
        sec["chosen"][f"{method} {name}"] = {"N": N, "K": K, "config": cfg, "ms": ms, "rule_ms": rule_ms,
                                             "GBps": gbps(fmt_bytes(p[method][0]), ms), "vs_bf16": sec["bf16"][name]["ms"] / ms,
                                             "of_copy_bw": gbps(fmt_bytes(p[method][0]), ms) / bw}
        log("chosen", method, name, cfg, f"{ms * 1e3:.1f}us (rule {rule_ms * 1e3:.1f}us), "
            f"{sec['chosen'][f'{method} {name}']['vs_bf16']:.2f}x bf16")
    del layers; cleanup()


# -- c. GEMM at T = 512 --------------------------------------------------------------------------------------------

def gemm512(res):
    rows = res["gemm_512"] = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, N, K, _ in layer_shapes("7B"):
        if name not in ("gate_up_proj", "down_proj"): continue
        w, _b = make_layer(N, K, False)
        x = torch.randn(512, K, device="cuda", dtype=torch.bfloat16)
        ms = bench(lambda: F.linear(x, w))
        rows.append({"layer": name, "N": N, "K": K, "format": "bf16", "ms": ms, "TFLOPs": 2 * 512 * N * K / ms / 1e9})
        for method in METHODS:
            p = packed(w, method)
            ms = bench(lambda: quant_gemm(x, *p, None, method, GROUP))
            rows.append({"layer": name, "N": N, "K": K, "format": method, "ms": ms,
                         "TFLOPs": 2 * 512 * N * K / ms / 1e9, "config": gemm_config(512, N, K, method, GROUP, sms)})
            del p
        del w, x; cleanup()
        log("gemm T=512", name, {r["format"]: f"{r['ms'] * 1e3:.0f}us" for r in rows[-3:]})


# -- d. engine decode step -----------------------------------------------------------------------------------------

def release(llm):
    "Abort the engine's requests and close it (the caller drops its reference, then cleanup())."
    if llm is None: return
    for i in list(llm._requests): llm.abort_request(i)
    llm.close()


def engine_decode(res, shape, model_dir, batches, num_kv_blocks):
    from nanoserve.engine import LLM
    rows = res.setdefault("decode", [])
    for q in (None, "int8", "int4"):
        if over():
            res.setdefault("skipped", []).append(f"decode {shape} {q}"); continue
        key = f"{shape} {q or 'bf16'}"
        cleanup()
        row = {"shape": shape, "quantization": q, "group_size": GROUP if q == "int4" else None,
               "allocated_before_GiB": torch.cuda.memory_allocated() / 2**30}
        llm = None
        try:
            t0 = time.perf_counter()
            kw = {} if q is None else {"quantization": q, "quant_group_size": GROUP}
            llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=num_kv_blocks, max_num_seqs=max(batches),
                      max_num_batched_tokens=2048, **kw)
            row |= {"weight_bytes": weight_bytes(llm.model), "num_kv_blocks": llm.num_kv_blocks,
                    "init_s": time.perf_counter() - t0, "batches": []}
            for b in batches:
                steady_decode(llm, b)
                warm_gpu(0.5, llm.device)
                times = []
                for _ in range(3):           # steps back to back, one sync per pass (async keeps its pipeline)
                    torch.cuda.synchronize(); t0 = time.perf_counter()
                    for _ in range(STEPS): llm.step()
                    torch.cuda.synchronize(); times.append((time.perf_counter() - t0) / STEPS * 1e3)
                best = min(times[1:])        # the first pass warms the pipeline
                row["batches"].append({"batch": b, "ms_per_step": times[1:], "warmup_ms": times[0], "median_ms": best,
                                       "timer": f"best of two passes of {STEPS} steps",
                                       "disagree": abs(times[1] - times[2]) > 0.15 * best,
                                       "tokens_per_s": b / (best / 1e3)})
                log("decode", key, f"batch {b}: {best:.3f} ms/step", times)
        except Exception as e:
            traceback.print_exc(); row["error"] = repr(e)[:500]
        finally:
            release(llm)
            llm = None
            cleanup()
        rows.append(row)
    base = {r["shape"]: r for r in rows if r.get("quantization") is None and r.get("batches")}
    for r in rows:
        if r.get("batches") and r["shape"] in base:
            by_b = {bb["batch"]: bb for bb in base[r["shape"]]["batches"]}
            for rb in r["batches"]:
                if rb["batch"] in by_b: rb["speedup_vs_bf16"] = by_b[rb["batch"]]["median_ms"] / rb["median_ms"]


# -- e. KV sizing --------------------------------------------------------------------------------------------------

def kv_sizing(res, shape, model_dir):
    "KV blocks the engine sizes by itself (eager, no graph capture) for each quantization; one engine alive at a time."
    from nanoserve.engine import LLM
    rows = res.setdefault("kv_sizing", [])
    for q in (None, "int8", "int4"):
        if over(BUDGET_S + 10):
            res.setdefault("skipped", []).append(f"kv {shape} {q}"); continue
        cleanup()
        row = {"shape": shape, "quantization": q, "allocated_before_GiB": torch.cuda.memory_allocated() / 2**30}
        llm = None
        try:
            kw = {} if q is None else {"quantization": q, "quant_group_size": GROUP}
            llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=32, enforce_eager=True, gpu_memory_utilization=0.9, **kw)
            row |= {"weight_bytes": weight_bytes(llm.model), "num_kv_blocks": llm.num_kv_blocks,
                    "block_size": llm.block_size}
        except Exception as e:
            traceback.print_exc(); row["error"] = repr(e)[:500]
        finally:
            release(llm)
            llm = None
            cleanup()
        log("kv sizing", row)
        rows.append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="correctness,sweep,gemm512,decode7b,decode05,kv")
    args = ap.parse_args()
    res = {"meta": run_meta(), "command": "PYTHONPATH=. python kernels/quant_h200.py --out $OUT", "dtype": "bfloat16",
           "group_size": GROUP, "gemv_max_t": Q.GEMV_MAX_T, "budget_s": BUDGET_S}
    out = Path(args.out) / "quant_h200.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    dirs = {}
    def model_dir(shape):
        if shape not in dirs: dirs[shape] = fast_random_checkpoint(shape)
        return dirs[shape]
    parts = {"correctness": lambda: correctness(res), "sweep": lambda: sweep(res), "gemm512": lambda: gemm512(res),
             "decode7b": lambda: engine_decode(res, "7B", model_dir("7B"), (1, 8, 32), num_kv_blocks=1024),
             "decode05": lambda: engine_decode(res, "0.5B", model_dir("0.5B"), (1, 8), num_kv_blocks=1024),
             "kv": lambda: kv_sizing(res, "0.5B", model_dir("0.5B"))}
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        if over(BUDGET_S + (10 if name == "kv" else 0)):
            res.setdefault("skipped", []).append(name); log("skipped", name); continue
        log(f"part {name} ...")
        try: parts[name]()
        except Exception as e:
            traceback.print_exc(); res[f"{name}_error"] = repr(e)[:500]
        cleanup()
        res.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
        res["gemv_overrides"] = {f"{m} {n}x{k}": c for (m, n, k), c in GEMV_OVERRIDES.items()}
        res["total_seconds"] = time.perf_counter() - T0
        out.write_text(json.dumps(res, indent=1, default=str))
        log(f"part {name}: {time.perf_counter() - t0:.0f} s, wrote {out}")
    log("done")


if __name__ == "__main__":
    main()

"""The weight-only quantization chapter on the H200: kernel correctness, a GEMV configuration sweep, prefill GEMMs,
the engine's decode step and KV sizing, with random weights (no checkpoint).

Run on the device machine from the repo root:
    PYTHONPATH=. python kernels/quant_h200.py --out $OUT [--parts correctness,sweep,gemm512,decode7b,decode05,kv]
Writes quant_h200.json (run metadata inside) after every part; copy it to figures/data/. In bf16, INT4 group 128:

a. correctness (checked first, asserted): the 7B layer shapes, INT8 and INT4, T in (1, 4, 16, 512): max relative
   error against the reference (dequantize to fp32, fp32 matmul) of the dispatch (`quant_matmul`, on the layout
   `QuantLinear` stores and on rows), the FMA GEMV (T <= the table's gemv_max_t), the tensor-core GEMM (T > 1), and
   at one row the one-row options over the tuned table (`OPTIONS`, passed as `config=`); one CUDA-graph capture and
   replay;
b. sweep: the GEMV at T = 1 on the 7B shapes, the package's choice first, then BLOCK_N x BLOCK_K x warps
   candidates (each passed as `tuned=`: the candidate in place of the table's entry), each timed by `graph_bench`
   (calls over enough weight copies to defeat L2, captured in one CUDA graph; the faster of two passes), against
   bf16 F.linear and the copy bandwidth of the same run; the best per (method, layer) is recorded ("chosen"), the
   package's table unchanged;
c. gemm512: the GEMM at T = 512 for gate_up and down: bf16 F.linear, INT8, INT4;
d. decode7b, decode05: the engine's decode step (CUDA graphs, async scheduling), quantization None, "int8",
   "int4", 7B at batch 1, 8, 32 and 0.5B at batch 1, 8: ms per step, two passes after a warm-up pass
   (`lab.step_ms_twice`, >15% flagged);
e. kv: the KV blocks the engine sizes by itself on the 0.5B shape for each quantization (eager).
`--smoke`: the same parts on tiny shapes on the CPU under the interpreter (the engine on the built-in tiny model).
"""
import gc, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, device_or_skip, exit_if_failed, free, graph_bench, is_smoke, layer_shapes, max_rel_err, median,
                 operand_copies, parser, random_linear, run_parts, saver, step_ms_twice, sync, tensor_bytes, time_cuda,
                 tiny_model)

import torch
import torch.nn.functional as F

import nanoserve.quant as Q
from nanoserve.bench import random_checkpoint

GROUP = 128
METHODS = ("int8", "int4")
STEPS = 100                # decode steps a timed pass
SWEEP_S = 70.0             # the GEMV sweep's budget (compiles dominate)
TINY = [("qkv_proj", 384, 256, True), ("down_proj", 256, 512, False)]      # --smoke's layers
OPTIONS = {"int4": {"gemv_pairs_cvt": {"SHIFT": False}, "gemv_pairs_shift": {"SHIFT": True},
                    "gemv_words_fp32": {"HALF2": False}},
           "int8": {"gemv_f16": {"F16": True}, "gemv_f16_64x128": {"F16": True, "BLOCK_N": 64, "BLOCK_K": 128,
                                                                  "num_warps": 4, "SPLIT_K": None}}}
# the one-row options, each over the tuned table (the packed paths are the interpreter's emulation on a CPU)


# ---- operands -------------------------------------------------------------------------------------------------
def packed(w, method, rows: bool = False):
    "`w` quantized, in the layout `QuantLinear` stores (INT4: tiled where `gemv_tile` says; `rows`: row-major)."
    if method == "int8": return Q.quantize_int8(w) + (None,)
    tile = 0 if rows else Q.gemv_tile(w.shape[0], w.shape[1], GROUP)
    return Q.tile_int4(*Q.quantize_int4(w, GROUP), GROUP, tile) if tile else Q.quantize_int4(w, GROUP)


def cleanup(device):
    "Collect the dropped operands and give the allocator's cache back, between layers and engines."
    gc.collect(); sync(device); free(device)


# ---- a. correctness ----------------------------------------------------------------------------------------------
def correctness_row(name, N, K, method, T, w, b, p, x):
    ref = Q.quant_matmul_ref(x.float(), *p, None if b is None else b.float(), method, GROUP)    # fp32 reference
    row = {"layer": name, "N": N, "K": K, "method": method, "T": T,
           "auto": max_rel_err(Q.quant_matmul(x, *p, b, method, GROUP), ref)}
    if method == "int4":                                          # the row-major layout too
        row["auto_rows"] = max_rel_err(Q.quant_matmul(x, *packed(w, method, rows=True), b, method, GROUP), ref)
        row["tile"] = Q.weight_layout(p[0])[0]
    if T <= Q.quant_tables()["gemv_max_t"]: row["gemv_fma"] = max_rel_err(Q.quant_gemv(x, *p, b, method, GROUP), ref)
    if T == 1:
        for opt, cfg in OPTIONS[method].items():
            row[opt] = max_rel_err(Q.quant_gemv(x, *p, b, method, GROUP, config=cfg), ref)
    if T > 1: row["gemm"] = max_rel_err(Q.quant_gemm(x, *p, b, method, GROUP), ref)
    return row


def graph_replay(res, device, dtype, smoke):
    "Each path captured once in a CUDA graph and replayed on new inputs (GPU only)."
    if device.type != "cuda": return
    graph = {}
    w, b = random_linear(4608, 3584, True, device, dtype)
    for method in METHODS:
        p = packed(w, method)
        for T in (1, 16):
            x = torch.randn(T, 3584, device=device, dtype=dtype)
            Q.quant_matmul(x, *p, b, method, GROUP); sync(device)                      # compiled outside capture
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr): out = Q.quant_matmul(x, *p, b, method, GROUP)
            x.copy_(torch.randn_like(x)); gr.replay(); sync(device)
            graph[f"{method} T={T}"] = max_rel_err(out, Q.quant_matmul_ref(x.float(), *p, b, method, GROUP))
    res["correctness"]["cuda_graph_replay_rel_err"] = graph
    print("graph replay", graph, flush=True)


def correctness(res, device, dtype, smoke):
    rows = []
    res["correctness"] = {"reference": "dequantize to fp32, fp32 matmul (x rounded first)", "rows": rows}
    for name, N, K, has_bias in layer_shapes("7B", smoke, TINY):
        w, b = random_linear(N, K, has_bias, device, dtype)
        for method in METHODS:
            p = packed(w, method)
            g = torch.Generator(device=device).manual_seed(1)
            for T in ((1, 4) if smoke else (1, 4, 16, 512)):
                x = torch.randn(T, K, device=device, dtype=dtype, generator=g)
                rows.append(correctness_row(name, N, K, method, T, w, b, p, x))
        cleanup(device)
    paths = ("auto", "auto_rows", "gemv_fma", "gemm")
    res["correctness"]["max_rel_err"] = worst = max(r[k] for r in rows for k in paths if k in r)
    res["correctness"]["options_max_rel_err"] = opts = {o: max(r[o] for r in rows if o in r)
                                                        for m in OPTIONS for o in OPTIONS[m]}
    print(f"correctness: max rel err {worst:.2e}, options {opts}", flush=True)
    graph_replay(res, device, dtype, smoke)
    assert worst < 0.02 and max(opts.values()) < 0.02, (worst, opts)


# ---- b. GEMV sweep -----------------------------------------------------------------------------------------------
def candidates(method, smoke):
    "The package's choice first (None: the table's entry), then one change at a time, then combinations."
    bk = [128, 256, 512] if method == "int8" else [256, 512, 1024]
    base = {"BLOCK_N": 32, "BLOCK_K": 256 if method == "int8" else 512, "num_warps": 4}
    out = [None]
    def add(c):
        if c not in out: out.append(c)
    for n in (16, 64): add({**base, "BLOCK_N": n})
    for k in bk: add({**base, "BLOCK_K": k})
    add({**base, "num_warps": 8})
    for n in (16, 32, 64):
        for k in bk:
            for nw in (4, 8): add({"BLOCK_N": n, "BLOCK_K": k, "num_warps": nw})
    if method == "int4":                         # the first version's interleaved nibbles, for the same tiles
        for c in list(out[1:7]): add({**c, "PAIRS": False})
    return out[:2] if smoke else out


def sweep_layers(sec, device, dtype, smoke):
    "Per 7B layer: the input, the quantized copies, and bf16 F.linear's time."
    layers = {}
    for name, N, K, _ in layer_shapes("7B", smoke, TINY):
        w, _b = random_linear(N, K, False, device, dtype)
        x = torch.randn(1, K, device=device, dtype=dtype)
        ws = operand_copies((w,), 2 * N * K)
        ms = min(graph_bench(lambda i: (lambda: F.linear(x, ws[i][0])), 2 * N * K, device=device)) / 1e3
        sec["bf16"][name] = {"ms": ms, "GBps": 2 * N * K / ms / 1e6}
        layers[name] = (N, K, x, {m: operand_copies(packed(w, m), tensor_bytes(packed(w, m))) for m in METHODS})
    return layers


def time_candidate(sec, method, name, layer, cfg, sms, first):
    "One candidate (`tuned=`) on one layer: a row of the sweep."
    N, K, x, p = layer
    try:
        full = {k: v for k, v in Q.gemv_config(1, N, K, method, GROUP, sms, tuned=cfg).items() if k != "SUB_K"}
        qb = tensor_bytes(p[method][0])
        ms = min(graph_bench(lambda j: (lambda: Q.quant_gemv(x, *p[method][j], None, method, GROUP, tuned=cfg)),
                             qb, device=x.device)) / 1e3                  # the faster of two passes
        gb = qb / ms / 1e6
        row = {"method": method, "layer": name, **full, "ms": ms, "GBps": gb, "package": first,
               "of_copy_bw": gb / sec["copy_bandwidth_GBps"], "vs_bf16": sec["bf16"][name]["ms"] / ms}
    except Exception as e:                                       # a candidate that does not compile
        row = {"method": method, "layer": name, **(cfg or {}), "error": repr(e)[:300]}
    sec["rows"].append(row)
    return row


def copy_bandwidth(device, size=1 << 30):
    "GB/s of a device-to-device copy of `size` bytes (reads and writes)."
    if device.type != "cuda": size = 1 << 20
    x = torch.empty(size // 2, dtype=torch.bfloat16, device=device); y = torch.empty_like(x)
    s = median(time_cuda(lambda: y.copy_(x), reps=20, warmup=3, device=device))
    return 2 * size / s / 1e9


def sweep(res, device, dtype, smoke):
    sec = res["gemv_sweep"] = {"T": 1, "timer": "graph_bench: a CUDA graph of calls over weight copies (>= 256 MB)",
                               "group_size": GROUP, "rows": [], "chosen": {}, "bf16": {},
                               "copy_bandwidth_GBps": copy_bandwidth(device)}
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    layers = sweep_layers(sec, device, dtype, smoke)
    cands, t_start = {m: candidates(m, smoke) for m in METHODS}, time.perf_counter()
    for i in range(max(len(c) for c in cands.values())):           # methods interleaved, within the budget
        for method in METHODS:
            if i >= len(cands[method]) or time.perf_counter() - t_start > SWEEP_S: continue
            for name, layer in layers.items():
                time_candidate(sec, method, name, layer, cands[method][i], sms, i == 0)
    for method in METHODS:
        for name in layers:
            ok = [r for r in sec["rows"] if r["method"] == method and r["layer"] == name and "ms" in r]
            best, pkg = min(ok, key=lambda r: r["ms"]), next(r for r in ok if r["package"])
            sec["chosen"][f"{method} {name}"] = {**best, "package_ms": pkg["ms"]}
            print("chosen", method, name, f"{best['ms'] * 1e3:.1f} us (the package's {pkg['ms'] * 1e3:.1f} us)",
                  flush=True)
    del layers; cleanup(device)


# ---- c. GEMM at 512 rows -----------------------------------------------------------------------------------------
def gemm512(res, device, dtype, smoke):
    rows = res["gemm_512"] = []
    T = 16 if smoke else 512
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    for name, N, K, _ in layer_shapes("7B", smoke, TINY):
        if name not in ("gate_up_proj", "down_proj"): continue
        w, _b = random_linear(N, K, False, device, dtype)
        x = torch.randn(T, K, device=device, dtype=dtype)
        ms = median(time_cuda(lambda: F.linear(x, w), device=device)) * 1e3
        rows.append({"layer": name, "N": N, "K": K, "T": T, "format": "bf16", "ms": ms,
                     "TFLOPs": 2 * T * N * K / ms / 1e9})
        for method in METHODS:
            p = packed(w, method)
            ms = median(time_cuda(lambda: Q.quant_gemm(x, *p, None, method, GROUP), reps=2 if smoke else 20,
                                  device=device)) * 1e3
            rows.append({"layer": name, "N": N, "K": K, "T": T, "format": method, "ms": ms,
                         "TFLOPs": 2 * T * N * K / ms / 1e9, "config": Q.gemm_config(T, N, K, method, GROUP, sms)})
        cleanup(device)
        print(f"gemm T={T}", name, {r["format"]: f"{r['ms'] * 1e3:.0f}us" for r in rows[-3:]}, flush=True)


# ---- d. the engine's decode step, e. KV sizing -------------------------------------------------------------------
def engine(model_dir, q, device, smoke, **kw):
    "An engine with quantization `q` (None: bf16); the tiny model (fp32, groups of 16) under --smoke."
    group = 16 if smoke else GROUP
    quant = {} if q is None else {"quantization": q, "quant_group_size": group}
    base = {"device": "cpu", "dtype": "float32"} if smoke else {"dtype": "bfloat16"}
    return LLM(model_dir, **base, **quant, **kw)


def time_decode(llm, batch, smoke):
    "ms per decode step, two passes of back-to-back steps (one sync each), after a warm-up pass."
    a, b, disagree = step_ms_twice(llm, batch, 2 if smoke else STEPS, prompt_len=16 if smoke else 128, warm_s=0.5)
    return {"batch": batch, "ms_per_step": [a, b], "median_ms": min(a, b), "disagree": disagree,
            "tokens_per_s": batch / (min(a, b) / 1e3)}


def decode(res, shape, batches, device, smoke):
    rows = res.setdefault("decode", [])
    model_dir = tiny_model() if smoke else random_checkpoint(shape)
    for q in (None, "int8", "int4"):
        cleanup(device)
        llm = engine(model_dir, q, device, smoke, num_kv_blocks=256 if smoke else 1024, max_num_seqs=max(batches),
                     max_num_batched_tokens=2048)
        row = {"shape": shape, "quantization": q, "weight_bytes": Q.weight_bytes(llm.model),
               "num_kv_blocks": llm.num_kv_blocks, "batches": [time_decode(llm, b, smoke) for b in batches]}
        print("decode", shape, q, [(r["batch"], round(r["median_ms"], 3)) for r in row["batches"]], flush=True)
        llm.close(); del llm
        rows.append(row)
    base = {r["shape"]: {b["batch"]: b["median_ms"] for b in r["batches"]} for r in rows if r["quantization"] is None}
    for r in rows:
        for b in r["batches"]: b["speedup_vs_bf16"] = base[r["shape"]][b["batch"]] / b["median_ms"]


def kv_sizing(res, device, smoke):
    "The KV blocks the engine sizes by itself (eager, no graph capture) for each quantization, one engine at a time."
    rows = res.setdefault("kv_sizing", [])
    model_dir = tiny_model() if smoke else random_checkpoint("0.5B")
    for q in (None, "int8", "int4"):
        cleanup(device)
        llm = engine(model_dir, q, device, smoke, max_num_seqs=32, enforce_eager=True,
                     **({} if smoke else {"gpu_memory_utilization": 0.9}))
        rows.append({"shape": "tiny" if smoke else "0.5B", "quantization": q, "weight_bytes": Q.weight_bytes(llm.model),
                     "num_kv_blocks": llm.num_kv_blocks, "block_size": llm.block_size})
        print("kv sizing", rows[-1], flush=True)
        llm.close(); del llm


def main():
    args = parser(__doc__, parts="correctness,sweep,gemm512,decode7b,decode05,kv").parse_args()
    device, smoke = device_or_skip(args), is_smoke(args)
    dtype = torch.bfloat16                     # the kernels' parts (the engine's smoke runs the tiny model in fp32)
    res = {"dtype": "bfloat16", "group_size": GROUP, "gemv_max_t": Q.quant_tables()["gemv_max_t"]}
    parts = {"correctness": lambda: correctness(res, device, dtype, smoke),
             "sweep": lambda: sweep(res, device, dtype, smoke),
             "gemm512": lambda: gemm512(res, device, dtype, smoke),
             "decode7b": lambda: decode(res, "7B", (1, 2) if smoke else (1, 8, 32), device, smoke),
             "decode05": lambda: decode(res, "0.5B", (1,) if smoke else (1, 8), device, smoke),
             "kv": lambda: kv_sizing(res, device, smoke)}
    run_parts(parts, args.parts, saver("quant_h200.json", res, args))
    exit_if_failed(res)


if __name__ == "__main__":
    main()

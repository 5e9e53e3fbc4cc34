"""The INT4 tensor-core GEMM on the H200: the nibbles interleaved in registers and converted one by one (the
package's first path, `PACKED: False`) against the weights read as int32 words and dequantized two at a time in
packed bf16 pairs (`PACKED`, `DEQUANT_ASM`; the package's path since git f80aa99), per 7B projection; then the 7B
decode step at batch 8 and 32 with each, against bf16, in one run (issue 9).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/quant_gemm_h200.py --out $OUT
Writes quant_gemm_h200.json (raw numbers, git sha, GPU, versions, date) after every part; copy it to figures/data/.
a. gemm: each projection at T in (8, 32): bf16 F.linear, the nibble path (the rule's tiles), and PACKED
   over a few tiles (BLOCK_N, num_warps 4 or 8, num_stages 3 or 4; BLOCK_K = the group), each timed by
   graph_bench (calls over enough weight copies to defeat L2, captured in one CUDA graph); max relative error
   against the fp32 reference.
   The best PACKED tiles per (layer, T) are kept for part b. `--parts prefill` does the same at 128 and 512 rows,
   into "prefill".
b. rate: the 7B decode step (CUDA graphs, async scheduling) at batch 8 and 32: bf16, INT4 on the nibble path (the
   package's `gemm_config` wrapped to turn PACKED off; row name "int4"), INT4 with PACKED and part a's best tiles
   ("int4 packed"), two timed passes each.
"""
import json, sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import graphs_h200 as G                                                       # noqa: E402
from diet_h200 import layer_operands, layer_shapes, quantized_copies          # noqa: E402
import nanoserve.quant as Q                                                   # noqa: E402

ORIGINAL_GEMM_CONFIG = Q.gemm_config
BEST: dict[tuple[int, int, int], dict] = {}            # (N, K, T bucket) -> PACKED tiles


NIBBLES = {"PACKED": False}                            # the control: INT4 unpacked nibble by nibble


def packed_gemm_config(M, N, K, method, group_size, sms, config=None):
    "The package's GEMM rule, with PACKED (and part a's best tiles for this layer and row bucket) for INT4."
    if method != "int4": return ORIGINAL_GEMM_CONFIG(M, N, K, method, group_size, sms, config)
    extra = {"PACKED": True, **BEST.get((N, K, 8 if M <= 16 else 32), {})}
    return ORIGINAL_GEMM_CONFIG(M, N, K, method, group_size, sms, {**extra, **(config or {})})


def nibble_gemm_config(M, N, K, method, group_size, sms, config=None):
    "The package's GEMM rule with PACKED off (the control)."
    return ORIGINAL_GEMM_CONFIG(M, N, K, method, group_size, sms, {**(config or {}), **NIBBLES})


def gemm(res, row_counts=(8, 32), key="gemm"):
    rows = res[key] = []
    tiles = [{"BLOCK_N": n, "num_warps": w, "num_stages": s} for n in (64, 128) for w in (4, 8) for s in (3, 4)]
    for name, N, K, act, bias in layer_shapes("7B"):
        w, b, _, nbytes, ws = layer_operands(N, K, False, bias)
        q, qs, qb = quantized_copies(w, "int4")
        for T in row_counts:
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            ref = Q.quant_matmul_ref(x.float(), *q, None if b is None else b.float(), "int4", 128)
            err = lambda out: ((out.float() - ref).abs().max() / ref.abs().max()).item()
            row = {"layer": name, "N": N, "K": K, "T": T,
                   "bf16_us": min(G.graph_bench(lambda i: (lambda: F.linear(x, ws[i], b)), nbytes)),
                   "int4_us": min(G.graph_bench(lambda i: (lambda: Q.quant_gemm(x, *qs[i], b, "int4", 128,
                                                                                config=NIBBLES)), qb)),
                   "int4_err": err(Q.quant_gemm(x, *q, b, "int4", 128, config=NIBBLES)), "packed": []}
            for cfg in [{}] + tiles:
                c = {"PACKED": True, **cfg}
                us = min(G.graph_bench(lambda i: (lambda: Q.quant_gemm(x, *qs[i], b, "int4", 128, config=c)), qb))
                row["packed"].append({**c, "us": us, "rel_err": err(Q.quant_gemm(x, *q, b, "int4", 128, config=c))})
            best = min(row["packed"], key=lambda r: r["us"])
            row["best_packed"] = best
            if T <= 32:                                    # decode rows: the tiles part b runs with
                BEST[(N, K, T)] = {k: best[k] for k in ("BLOCK_N", "num_warps", "num_stages") if k in best}
            print(f"gemm {name} T={T}: bf16 {row['bf16_us']:.1f} us, int4 {row['int4_us']:.1f} us, packed "
                  f"{best['us']:.1f} us {BEST.get((N, K, T), '')}, errs {row['int4_err']:.1e} "
                  f"{max(r['rel_err'] for r in row['packed']):.1e}", flush=True)
            rows.append(row)
        del qs, ws; torch.cuda.empty_cache()
    res["best_packed_tiles"] = {f"{n}x{k} T={t}": c for (n, k, t), c in BEST.items()}


def rate(res):
    model = G.fast_random_checkpoint("7B")
    G.step_rates(model, res, "7B", [8, 32], [("bf16", {})], "rate")
    try:                                               # gemm_launch looks the rule up in the module
        for name, rule in (("int4", nibble_gemm_config), ("int4 packed", packed_gemm_config)):
            Q.gemm_config = rule
            G.step_rates(model, res, "7B", [8, 32], [(name, {"quantization": "int4"})], "rate")
    finally:
        Q.gemm_config = ORIGINAL_GEMM_CONFIG


def main():
    args, res, out = G.script_args("quant_gemm_h200", "gemm,rate")
    G.run_parts({"gemm": lambda: gemm(res), "rate": lambda: rate(res),
                 "prefill": lambda: gemm(res, (128, 512), "prefill")}, args.parts, res, out)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

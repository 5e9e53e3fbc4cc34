"""The INT4 tensor-core GEMM on the H200: the nibbles unpacked one by one (`PACKED: False`) against the weights read
as int32 words and dequantized two at a time in packed bf16 pairs (`PACKED`, `DEQUANT_ASM`: the package's path),
per 7B projection over a few tiles; then the 7B decode step at batch 8 and 32, bf16 against INT4 as shipped.

Run on the device machine from the repo root:
    PYTHONPATH=. python kernels/quant_gemm_h200.py --out $OUT [--parts gemm,rate,prefill]
Writes quant_gemm_h200.json (run metadata inside) after every part; copy it to figures/data/.
a. gemm: each projection at T in (8, 32): bf16 F.linear, the nibble path, and PACKED over a few tiles (BLOCK_N,
   num_warps 4 or 8, num_stages 3 or 4; BLOCK_K = the group), each passed to `quant_gemm` as `config=`, checked
   against the fp32 reference (max relative error, asserted), then timed by `graph_bench` (calls over enough weight
   copies to defeat L2, captured in one CUDA graph). `prefill` does the same at 128 and 512 rows.
b. rate: the 7B decode step (CUDA graphs, async scheduling) at batch 8 and 32, bf16 and INT4, two passes each
   after a warm-up pass (`lab.step_ms_twice`). The engine takes the package's GEMM rule; an A/B of GEMM tiles is
   part a's, per call.
`--smoke`: the same on tiny shapes on the CPU under the interpreter (the engine on the built-in tiny model).
"""
import gc, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, device_or_skip, exit_if_failed, free, graph_bench, is_smoke, layer_shapes, max_rel_err,
                 operand_copies, parser, random_linear, run_parts, saver, step_ms_twice, tensor_bytes, tiny_model)

import torch
import torch.nn.functional as F

import nanoserve.quant as Q
from nanoserve.bench import random_checkpoint

GROUP = 128
NIBBLES = {"PACKED": False}                            # the control: INT4 unpacked nibble by nibble
TINY = [("o_proj", 256, 256, False), ("down_proj", 256, 512, False)]   # --smoke's layers


def tiles(smoke: bool) -> list[dict]:
    "The PACKED tiles tried: the rule's, then BLOCK_N x warps x stages."
    out = [{}] + [{"BLOCK_N": n, "num_warps": w, "num_stages": s} for n in (64, 128) for w in (4, 8) for s in (3, 4)]
    return out[:2] if smoke else out


def gemm_row(name, N, K, T, w, b, q, qs, device, smoke):
    "One projection at T rows: bf16, the nibble path and each PACKED tile, checked, then timed."
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    ref = Q.quant_matmul_ref(x.float(), *q, None if b is None else b.float(), "int4", GROUP)
    err = lambda cfg: max_rel_err(Q.quant_gemm(x, *q, b, "int4", GROUP, config=cfg), ref)
    configs = [NIBBLES] + [{"PACKED": True, **t} for t in tiles(smoke)]
    errs = [err(c) for c in configs]                                 # check first
    assert max(errs) < 0.02, (name, T, errs)
    ws = operand_copies((w,), 2 * N * K)
    qb = tensor_bytes(q)
    us = lambda make_call, nbytes: min(graph_bench(make_call, nbytes, device=device))   # the faster of two passes
    time_of = lambda cfg: us(lambda i: (lambda: Q.quant_gemm(x, *qs[i], b, "int4", GROUP, config=cfg)), qb)
    row = {"layer": name, "N": N, "K": K, "T": T, "weight_bytes": qb,
           "bf16_us": us(lambda i: (lambda: F.linear(x, ws[i][0], b)), 2 * N * K),
           "int4_us": time_of(NIBBLES), "int4_err": errs[0],
           "packed": [{**c, "us": time_of(c), "rel_err": e} for c, e in zip(configs[1:], errs[1:])]}
    row["best_packed"] = min(row["packed"], key=lambda r: r["us"])
    print(f"gemm {name} T={T}: bf16 {row['bf16_us']:.1f} us, nibbles {row['int4_us']:.1f} us, packed "
          f"{row['best_packed']['us']:.1f} us {row['best_packed']}", flush=True)
    return row


def gemm(res, device, smoke, row_counts, key):
    rows = res[key] = []
    for name, N, K, bias in layer_shapes("7B", smoke, TINY):
        w, b = random_linear(N, K, bias, device)
        q = Q.quantize_int4(w, GROUP)
        qs = operand_copies(q, tensor_bytes(q))
        for T in row_counts: rows.append(gemm_row(name, N, K, T, w, b, q, qs, device, smoke))
        del qs, w; gc.collect(); free(device)


def rate(res, smoke, batches):
    "ms per decode step, bf16 and INT4 (two passes each after a warm-up pass), one engine alive at a time."
    rows = res.setdefault("rate", [])
    model_dir = tiny_model() if smoke else random_checkpoint("7B")
    steps = 2 if smoke else 200
    for cname, q in (("bf16", {}), ("int4", {"quantization": "int4", "quant_group_size": 16 if smoke else GROUP})):
        base = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 256} if smoke else {"dtype": "bfloat16",
                                                                                            "num_kv_blocks": 4096}
        llm = LLM(model_dir, **base, **q, max_num_seqs=max(batches), max_num_batched_tokens=2048)
        for b in batches:
            a, b2, disagree = step_ms_twice(llm, b, steps, prompt_len=16 if smoke else 128, warm_s=1.0)
            rows.append({"shape": "tiny" if smoke else "7B", "config": cname, "batch": b, "ms_per_step": [a, b2],
                         "best_ms": min(a, b2), "disagree": disagree})
            print("rate", rows[-1], flush=True)
        llm.close(); del llm


def main():
    args = parser(__doc__, parts="gemm,rate").parse_args()
    device, smoke = device_or_skip(args), is_smoke(args)
    res = {"group_size": GROUP, "timer": "graph_bench (us per call, the faster of two passes)"}
    parts = {"gemm": lambda: gemm(res, device, smoke, (8,) if smoke else (8, 32), "gemm"),
             "prefill": lambda: gemm(res, device, smoke, (16,) if smoke else (128, 512), "prefill"),
             "rate": lambda: rate(res, smoke, (2,) if smoke else (8, 32))}
    run_parts(parts, args.parts + (",prefill" if smoke else ""), saver("quant_gemm_h200.json", res, args))
    exit_if_failed(res)


if __name__ == "__main__":
    main()

"""The one-launch MLP (`mlp_row`, the fused chapter) against the two `gemv` launches it replaces, at one row.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/mlp_row_h200.py --out $OUT [--shapes 0.5B,qwen3-0.6B]

For each shape's MLP (seeded random bf16 weights of the real sizes): check `mlp_row` against the pair (the gate/up
`gemv` with the norm taken in, then the down `gemv` with SiLU x up taken in: the batch-1 step's path) at every
block configuration (max relative error; the fp32 check against `mlp_row_ref` is the chapter's, on the CPU), then
time the pair and each configuration as a step launches them (`lab.graph_bench`: calls over enough weight copies
to miss L2, captured in one CUDA graph, with programmatic dependent launch; two passes, >15% apart flagged), and
write mlp_row_h200.json with each shape's weight bytes over the copy bandwidth beside it. `--smoke`: a tiny shape
in fp32 on the CPU under the interpreter.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (SHAPES, copy_bandwidth_GBps, device_or_skip, disagree, graph_bench, is_smoke, max_rel_err,  # noqa: E402
                 median, parser, write)

import torch  # noqa: E402

from nanoserve.fused import gemv, mlp_row  # noqa: E402
from nanoserve.runtime import pdl_supported  # noqa: E402

CONFIGS = ({}, {"BLOCK_I": 8}, {"BLOCK_I": 32, "BLOCK_K": 256}, {"BLOCK_K": 256, "num_warps": 4},
           {"BLOCK_I": 8, "num_warps": 4}, {"BLOCK_I": 8, "BLOCK_K": 1024}, {"BLOCK_H": 128}, {"BLOCK_H": 512})


def operands(H: int, I: int, device, dtype, copies: int) -> tuple:
    "x, residual, norm weight, and `copies` (gate/up [2I, H], down [H, I]) weight pairs, seeded."
    g = torch.Generator(device=device).manual_seed(0)
    x, r = torch.randn(2, 1, H, device=device, dtype=dtype, generator=g)
    nw = torch.rand(H, device=device, dtype=dtype, generator=g) + 0.5
    ws = [(torch.randn(2 * I, H, device=device, dtype=dtype, generator=g) * 0.02,
           torch.randn(H, I, device=device, dtype=dtype, generator=g) * 0.02) for _ in range(copies)]
    return x, r, nw, ws


def pair(x, r, nw, gu, dw, pdl: bool):
    "The two launches of the step's path: gate/up with the norm in, down with SiLU x up in."
    gate_up, new_r = gemv(x, gu, pdl=pdl, norm=(nw, 1e-6), residual=r)
    return gemv(gate_up, dw, act=True, pdl=pdl), new_r


def one_shape(shape: str, device, dtype, pdl: bool, smoke: bool) -> dict:
    cfg = SHAPES[shape] if not smoke else {"hidden_size": 96, "intermediate_size": 200}
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nbytes = 3 * H * I * 2
    x, r, nw, ws = operands(H, I, device, dtype, 2 if smoke else max(1, min(32, -(-(256 << 20) // nbytes))))
    ref, ref_r = pair(x, r, nw, *ws[0], pdl)
    row = {"shape": shape, "H": H, "I": I, "weight_bytes": nbytes, "configs": []}
    us = graph_bench(lambda i: (lambda: pair(x, r, nw, *ws[i % len(ws)], pdl)), nbytes, device=device)
    row["pair_us"], row["pair_disagree"] = us, disagree(*us) if len(us) > 1 else False
    for config in CONFIGS[:2] if smoke else CONFIGS:
        out, new_r = mlp_row(x, r, nw, 1e-6, *ws[0], pdl=pdl, config=config)
        err = max_rel_err(out, ref)
        assert torch.equal(new_r, ref_r) and err < 2e-2, (shape, config, err)
        us = graph_bench(lambda i: (lambda: mlp_row(x, r, nw, 1e-6, *ws[i % len(ws)], pdl=pdl, config=config)),
                         nbytes, device=device)
        row["configs"].append({"config": config, "us": us, "disagree": disagree(*us) if len(us) > 1 else False,
                               "max_rel_err": err})
        print(shape, config, [round(u, 2) for u in us], "pair", [round(u, 2) for u in row["pair_us"]], flush=True)
    best = min(row["configs"], key=lambda c: median(c["us"]))
    row["best"] = {"config": best["config"], "over_pair": median(best["us"]) / median(row["pair_us"])}
    return row


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--shapes", default="0.5B,qwen3-0.6B,llama3.2-1B,qwen3-1.7B,7B")
    ap.add_argument("--name", default="mlp_row_h200.json")
    args = ap.parse_args()
    smoke = is_smoke(args)
    device = device_or_skip(args)
    dtype = torch.float32 if smoke else torch.bfloat16
    pdl = pdl_supported(device)
    res = {"timer": "graph_bench (us per call)", "pdl": pdl, "shapes": []}
    if not smoke: res["copy_GBps"] = copy_bandwidth_GBps(device=device)[0]
    for shape in ["tiny"] if smoke else args.shapes.split(","):
        res["shapes"].append(one_shape(shape, device, dtype, pdl, smoke))
        write(args.name, res, args)


if __name__ == "__main__":
    main()

"""The one-row INT4 and INT8 GEMVs that make their own input, kernel by kernel, against the kernels they replace, on
the 7B layers (issue 28's INT4 2.5x). In the engine the made input made the INT8 step faster and the INT4 step
slower (`quant_made_input_h100.json`); compiled for sm_90 the INT4 gate/up kernel takes 96 registers made against 56
plain (`quant_sass_cpu.json`), and capped by ptxas at 80 it spills 16 bytes (the quantization notes). Per layer that
can make its input (QKV and gate/up: the residual add and RMSNorm; down: SiLU x up), per format:

- apart: `add_rmsnorm` (or `silu_mul`), then the plain GEMV (the package's INT4 default);
- made: the GEMV that makes its input (`quant_gemv(norm=...)` / `act=True`; the INT8 default);
- made, MAXNREG r: the same with ptxas capped at r registers (`--caps`).

Each timed with `graph_bench` (operands copied past L2, a CUDA graph of back-to-back calls, PDL on as in the
engine), two passes, the variants in turn, twice (flagged >15% apart), after a check of every made variant against
apart (products within bf16 rounding). Writes made_input_kernels_h200.json. `--smoke`: a small layer under the
interpreter (the pairs paths' PTX emulated in bf16), one pass.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/made_input_kernels_h200.py --out $OUT
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (device_or_skip, disagree, graph_bench, is_smoke, layer_shapes, max_rel_err, median,  # noqa: E402
                 operand_copies, parser, random_linear, tensor_bytes, warm, write)

import torch  # noqa: E402

from nanoserve.fused import add_rmsnorm, silu_mul  # noqa: E402
from nanoserve.quant import quant_gemv, quantize_weight  # noqa: E402

NAME = "made_input_kernels_h200.json"


def calls(layer: str, K: int, q: tuple, method: str, G, device, caps) -> tuple[dict, int]:
    "({variant: make_call(i)}, bytes a call reads) for one quantized layer [N, K] at one bf16 row."
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, 2 * K if layer == "down_proj" else K, device=device, generator=g).bfloat16()
    res, nw = torch.randn_like(x), (torch.rand(K, device=device, generator=g) + 0.5).bfloat16()
    nbytes = tensor_bytes(q)
    ops = operand_copies(q, nbytes)
    pdl = device.type == "cuda"                            # as in the engine (the interpreter has no PDL)
    gemv = lambda i, inp, **kw: quant_gemv(inp, *ops[i][:3], None, method, G, pdl=pdl, **kw)
    if layer == "down_proj":
        out = {"apart": lambda i: lambda: gemv(i, silu_mul(x, pdl=pdl)),
               **{f"made{cap}": (lambda c: lambda i: lambda: gemv(i, x, act=True, config=c))(cfg)
                  for cap, cfg in caps.items()}}
    else:
        out = {"apart": lambda i: lambda: gemv(i, add_rmsnorm(x, res, nw, 1e-6, pdl=pdl)[0]),
               **{f"made{cap}": (lambda c: lambda i: lambda: gemv(i, x, norm=(nw, 1e-6), residual=res, config=c)[0])(cfg)
                  for cap, cfg in caps.items()}}
    return out, nbytes


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--caps", default="64,72,80", help="ptxas register caps of the made variants, comma-separated")
    ap.add_argument("--methods", default="int4,int8")
    args = ap.parse_args()
    smoke, device = is_smoke(args), device_or_skip(args)
    shapes = [(n, N, K) for n, N, K, _ in layer_shapes("7B", smoke, tiny=(("gate_up_proj", 128, 256, False),
                                                                          ("down_proj", 128, 256, False)))]
    caps = {"": None, **{f", MAXNREG {c}": {"MAXNREG": int(c)} for c in args.caps.split(",") if c}}
    rows = []
    for method in args.methods.split(","):
        G = 128 if method == "int4" else None
        for layer, N, K in [s for s in shapes if s[0] != "o_proj"]:
            K_in = K                                       # the down projection's input is its gate/up row: 2 K
            w, _ = random_linear(N, K_in, False, device)
            q = quantize_weight(w, method, G or 128)
            made, nbytes = calls(layer, K_in, q, method, G, device, caps)
            ref = made["apart"](0)()
            errs = {v: max_rel_err(f(0)(), ref) for v, f in made.items() if v != "apart"}
            warm(device, 0 if smoke else 1.0)
            us = {v: [] for v in made}
            for _ in range(1 if smoke else 2):
                for v, f in made.items(): us[v].append(graph_bench(f, nbytes, passes=1 if smoke else 2, device=device))
            row = {"method": method, "layer": layer, "N": N, "K": K_in, "weight_bytes": nbytes, "rel_err": errs,
                   "us": us, "median_us": {v: median([t for rep in u for t in rep]) for v, u in us.items()},
                   "disagree": {v: disagree(min(u[0]), min(u[-1])) for v, u in us.items()}}
            row["made_over_apart"] = {v: t / row["median_us"]["apart"] for v, t in row["median_us"].items()}
            rows.append(row)
            print(method, layer, {v: round(t, 2) for v, t in row["median_us"].items()}, flush=True)
            assert all(e < 0.03 for e in errs.values()), errs
    write(NAME, {"what": "one-row GEMVs making their input against the kernels apart, us a call (graph_bench)",
                 "rows": rows}, args)


if __name__ == "__main__":
    main()

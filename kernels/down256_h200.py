"""The MLP's down projection at 64-256 rows with the SiLU-and-multiply taken into its loads, against what the
engine runs now (the `silu_mul` kernel, then cuBLAS's GEMM with its split-K reduce): a lead for issue 28's GPU
step at 256 rows, where these three kernels are ~13% of the 0.5B step (`decode256_profile_h200.json`).

    PYTHONPATH=. python kernels/down256_h200.py --out figures/data [--rows 64,128,256]

`silu_mul_down_kernel` reads the gate/up activations [M, 2I] tile by tile, makes silu(gate) * up in registers
(rounded to the weights' dtype, as `silu_mul` writes it), and multiplies it into the down projection's weight
[H, I] (nn.Linear's layout) on the tensor cores; with SPLIT_K > 1 the programs of one output tile each take a
slice of I and write fp32 partial sums, added by one torch reduction. `silu_mul_down` is the launcher,
`silu_mul_down_ref` the reference. In the tutorials' order, for the 0.5B, Qwen3-0.6B and 7B shapes at each
row count: check every configuration against the reference (`lab.rel_err` under 2% in bf16; a wrong one stops
the run; one that does not fit the SM's resources is recorded as skipped), time each (`lab.graph_bench`:
CUDA graphs over copies of the weights that overflow L2, two passes, flagged when they disagree by >15%) beside
the control, write down256_h200.json with the best configuration per case and its ratio to the control.
`--smoke`: fp32, one tiny shape and two configurations, under the interpreter.
"""
import itertools, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (copies_for_l2, device_or_skip, disagree, graph_bench, is_smoke, median, parser,  # noqa: E402
                 rel_err, write)

import torch, triton, triton.language as tl                                          # noqa: E402

from nanoserve.fused import silu_mul, silu_mul_ref                                 # noqa: E402

SHAPES = {"0.5B": (896, 4864), "qwen3-0.6B": (1024, 3072), "7B": (3584, 18944)}     # (hidden H, intermediate I)
CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=s)
           for bm, bn, bk, sk, w, s in itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4), (4, 8), (3, 4))]


@triton.jit
def silu_mul_down_kernel(gu_ptr, w_ptr, out_ptr, M, N, I, stride_gm, stride_wn, stride_os, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                             # rows of the activations [BLOCK_M]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                             # output channels [BLOCK_N]
    per_split = tl.cdiv(tl.cdiv(I, BLOCK_K), SPLIT_K) * BLOCK_K              # this program's slice of I
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * per_split, tl.minimum((pid_k + 1) * per_split, I), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a_mask = (rm[:, None] < M) & (rk[None, :] < I)
        g = tl.load(gu_ptr + rm[:, None] * stride_gm + rk[None, :], mask=a_mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + rm[:, None] * stride_gm + I + rk[None, :], mask=a_mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(w_ptr.dtype.element_ty).to(tl.float32)     # as silu_mul rounds it
        a = (act * u).to(w_ptr.dtype.element_ty)                                      # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None],
                    mask=(rn[None, :] < N) & (rk[:, None] < I), other=0.0)             # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w)
    out = out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def silu_mul_down(gate_up: torch.Tensor, weight: torch.Tensor, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1,
                  num_warps=4, num_stages=3) -> torch.Tensor:
    "silu(gate) * up of `gate_up` [M, 2I], times `weight` [H, I] transposed: [M, H]."
    M, I, N = gate_up.shape[0], weight.shape[1], weight.shape[0]
    assert gate_up.shape[1] == 2 * I and gate_up.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty((SPLIT_K, M, N), device=gate_up.device,
                      dtype=gate_up.dtype if SPLIT_K == 1 else torch.float32)    # [SPLIT_K, M, N] partial sums
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), SPLIT_K)
    silu_mul_down_kernel[grid](gate_up, weight, out, M, N, I, gate_up.stride(0), weight.stride(0), out.stride(0),
                               out.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K,
                               num_warps=num_warps, num_stages=num_stages)
    return out[0] if SPLIT_K == 1 else out.sum(0).to(gate_up.dtype)


def silu_mul_down_ref(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    "The engine's path: `silu_mul_ref` rounded to the activations' dtype, then the GEMM."
    return silu_mul_ref(gate_up).to(gate_up.dtype) @ weight.t()


def one_case(H: int, I: int, M: int, configs: list[dict], device, dtype) -> dict:
    "Every configuration checked and timed at M rows of a (H, I) down projection, beside the control."
    g = torch.Generator(device=device).manual_seed(0)
    gu = torch.randn(M, 2 * I, device=device, dtype=dtype, generator=g)
    w = (torch.randn(H, I, device=device, dtype=dtype, generator=g) / I ** 0.5)
    ref = silu_mul_down_ref(gu, w)
    nbytes = w.numel() * w.element_size()
    copies = [w] + [w.clone() for _ in range(copies_for_l2(nbytes, device) - 1)]      # graph_bench's i-th call: copy i
    ctl = graph_bench(lambda i: (lambda: silu_mul(gu) @ copies[i].t()), nbytes, device=device)
    rows = []
    for cfg in configs:
        try: err = rel_err(silu_mul_down(gu, w, **cfg), ref)
        except triton.runtime.errors.OutOfResources as e: rows.append({**cfg, "skipped": str(e)[:200]}); continue
        assert err < 0.02, f"H={H} I={I} M={M} {cfg}: relative error {err:.4f} against the reference"
        us = graph_bench(lambda i: (lambda: silu_mul_down(gu, copies[i], **cfg)), nbytes, device=device)
        rows.append({**cfg, "error": err, "us": us, "disagree": len(us) > 1 and disagree(*us[:2])})
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: median(r["us"])) if timed else None
    return {"H": H, "I": I, "M": M, "control_us": ctl, "trials": rows, "best": best,
            "best_over_control": median(best["us"]) / median(ctl) if best else None}


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--rows", default="64,128,256")
    args = ap.parse_args()
    device = device_or_skip(args)
    if is_smoke(args):
        shapes, rows, dtype = {"tiny": (48, 96)}, [8], torch.float32
        configs = [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=s, num_warps=4, num_stages=2) for s in (1, 2)]
    else:
        shapes, rows, dtype, configs = SHAPES, [int(x) for x in args.rows.split(",")], torch.bfloat16, CONFIGS
    cases = []
    for name, (H, I) in shapes.items():
        for M in rows:
            case = one_case(H, I, M, configs, device, dtype) | {"shape": name}
            assert case["best"] is not None, f"{name} at {M} rows: no configuration passed the check"
            cases.append(case)
            b = case["best"]
            print(f"{name:>11} M={M:4d}: control {median(case['control_us']):7.1f} us, best {median(b['us']):7.1f} us "
                  f"({case['best_over_control']:.2f}x) {dict((k, b[k]) for k in CONFIGS[0])}", flush=True)
    write("down256_h200.json", {"cases": cases, "command": "PYTHONPATH=. python kernels/down256_h200.py --out DIR"}, args)


if __name__ == "__main__":
    main()

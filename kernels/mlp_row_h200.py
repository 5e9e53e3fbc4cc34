"""A one-launch MLP (`mlp_row`, here) against the two `gemv` launches of the batch-1 step, at one row.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/mlp_row_h200.py --out $OUT [--shapes 0.5B,qwen3-0.6B]

`mlp_row` cuts the down projection along the activation's rows: the program that makes rows `r` of SiLU(gate) x up
multiplies them by the down weight's columns `r` at once and adds its share of every output into fp32 sums (atomic
adds); the last program rounds the sums and zeroes them. It was in the package behind a switch until this script
timed it slower than the pair on every shape (the fused chapter's "What was tried"). For each shape's MLP (seeded
random bf16 weights of the real sizes): check `mlp_row` against the pair (the gate/up `gemv` with the norm taken
in, then the down `gemv` with SiLU x up taken in: the batch-1 step's path) at every block configuration (max
relative error; under --smoke also against `mlp_row_ref` in fp32), then
time the pair and each configuration as a step launches them (`lab.graph_bench`: calls over enough weight copies
to miss L2, captured in one CUDA graph, with programmatic dependent launch; two passes, >15% apart flagged), and
write mlp_row_h200.json with each shape's weight bytes over the copy bandwidth beside it.

Beside them a lab variant that asks what a persistent kernel would buy: `mlp_barrier_kernel`, one program a
multiprocessor, each making its share of the activation rows into a global row, then a grid barrier (a counter
and a generation word, spun on), then its share of the down projection's outputs, whole. Against the pair it
prices a grid barrier against a kernel boundary under PDL: the question behind a one-kernel decode layer.
Every program must be resident at once for the barrier to finish, so the grid is the multiprocessor count (one
program each always fits) and a smoke run uses one program. `--smoke`: a tiny shape in fp32 on the CPU under the
interpreter.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (SHAPES, copy_bandwidth_GBps, device_or_skip, disagree, graph_bench, is_smoke, max_rel_err,  # noqa: E402
                 median, parser, write)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanoserve.fused import _gemv_weights, _load_k, _normed, _row_rstd, gemv, gemv_ref  # noqa: E402
from nanoserve.runtime import (launch_options, num_sms, pdl_launch_next, pdl_supported, pdl_wait,  # noqa: E402
                               split_counters, sum_last)


def mlp_row_ref(x, residual, norm_weight, eps, gate_up_weight, down_weight):
    """`(down(silu(gate) * up), x + residual)` of the norm of `x + residual`: the gate/up `gemv` with the norm in,
    its output rounded, then the down `gemv` with SiLU x up in."""
    gate_up, new_residual = gemv_ref(x, gate_up_weight, norm=(norm_weight, eps), residual=residual)
    return gemv_ref(gate_up.to(x.dtype), down_weight, act=True), new_residual

@triton.jit
def _normed_tile(x_ptr, res_ptr, norm_w_ptr, kk, H, rstd, HAS_RESIDUAL: tl.constexpr):
    "The `[BLOCK_K]` normalised inputs at `kk` (as `add_rmsnorm` rounds them), zeros past `H`."
    x = _load_k(x_ptr, kk, H, False)
    r = _load_k(res_ptr, kk, H, False) if HAS_RESIDUAL else x
    return _normed(x, r, _load_k(norm_w_ptr, kk, H, False), rstd, x_ptr.dtype.element_ty, HAS_RESIDUAL)

@triton.jit
def _mlp_act(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, gate_up_ptr, rows, H, I, eps, stride_gu, first,
             BLOCK_K: tl.constexpr, ROW: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    "silu(gate) * up [BLOCK_I] at activation `rows`, rounded as the two `gemv` launches round it."
    kk = tl.arange(0, BLOCK_K)
    up_ptr = gate_up_ptr + I * stride_gu                               # the up rows follow the gate rows
    w_gate = _gemv_weights(gate_up_ptr, rows, kk, I, H, stride_gu, False)            # [BLOCK_I, BLOCK_K]
    w_up = _gemv_weights(up_ptr, rows, kk, I, H, stride_gu, False)
    pdl_wait(PDL)                                                      # the first tile's weights are in flight
    rstd = _row_rstd(x_ptr, res_ptr, new_res_ptr, H, eps, first, ROW, HAS_RESIDUAL)
    xn = _normed_tile(x_ptr, res_ptr, norm_w_ptr, kk, H, rstd, HAS_RESIDUAL)[None, :]
    gate, up = w_gate * xn, w_up * xn
    for k0 in range(BLOCK_K, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xn = _normed_tile(x_ptr, res_ptr, norm_w_ptr, kk, H, rstd, HAS_RESIDUAL)[None, :]
        gate += _gemv_weights(gate_up_ptr, rows, kk, I, H, stride_gu, False) * xn
        up += _gemv_weights(up_ptr, rows, kk, I, H, stride_gu, False) * xn
    dtype = x_ptr.dtype.element_ty
    gate, up = sum_last(gate, 1).to(dtype).to(tl.float32), sum_last(up, 1).to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)

@triton.jit
def _mlp_down_add(act, down_ptr, sums_ptr, rows, H, I, stride_down, BLOCK_H: tl.constexpr):
    "This program's share of the down projection, `down[:, rows] @ act`, added into the fp32 `sums` [H]."
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        w = tl.load(down_ptr + h[:, None] * stride_down + rows[None, :],
                    mask=(h < H)[:, None] & (rows < I)[None, :], other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_I]
        tl.atomic_add(sums_ptr + h, sum_last(w * act[None, :], 1), mask=h < H, sem="relaxed")

@triton.jit
def _mlp_finish(sums_ptr, out_ptr, counter_ptr, H, BLOCK_H: tl.constexpr):
    "The last program to add its share rounds the sums into `out`, then zeroes them and the counter."
    tl.debug_barrier()                                                 # every thread's additions, before the counter
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            s = tl.load(sums_ptr + h, mask=h < H, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + h, s.to(out_ptr.dtype.element_ty), mask=h < H)
            tl.store(sums_ptr + h, tl.zeros_like(s), mask=h < H)
        tl.atomic_xchg(counter_ptr, 0)

@triton.jit
def mlp_row_kernel(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, gate_up_ptr, down_ptr, out_ptr, sums_ptr, counter_ptr,
                   H, I, eps, stride_gu, stride_down, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_H: tl.constexpr, ROW: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False):
    pdl_launch_next(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_I + tl.arange(0, BLOCK_I)                       # this program's rows of the activation
    act = _mlp_act(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, gate_up_ptr, rows, H, I, eps, stride_gu, pid == 0,
                   BLOCK_K, ROW, HAS_RESIDUAL, PDL)
    _mlp_down_add(act, down_ptr, sums_ptr, rows, H, I, stride_down, BLOCK_H)
    _mlp_finish(sums_ptr, out_ptr, counter_ptr, H, BLOCK_H)

_ZEROED_SUMS: dict = {}                  # device -> fp32 sums of `mlp_row`, made on first use

def zeroed_sums(device: torch.device, n: int) -> torch.Tensor:
    "The device's zeroed fp32 sums (at least `n`), which every `mlp_row` launch leaves zero."
    s = _ZEROED_SUMS.get(device)
    if s is None or s.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mlp_row: its sums must be made before CUDA-graph capture (run the step once first)")
        s = _ZEROED_SUMS[device] = torch.zeros(max(n, 8192), dtype=torch.float32, device=device)
    return s


MLP_ROW_CONFIG = {"BLOCK_I": 16, "BLOCK_K": 512, "BLOCK_H": 256, "num_warps": 8}   # 1024-wide K tiles spill at sm_90


def mlp_row(x, residual, norm_weight, eps, gate_up_weight, down_weight, pdl: bool = False, config: dict | None = None):
    """`mlp_row_ref` in one launch: x, residual [1, H]; gate_up_weight [2I, H] (gate rows, then up); down_weight
    [H, I] -> `(out [1, H], x + residual)`."""
    (_, H), I = x.shape, down_weight.shape[1]
    cfg = {**MLP_ROW_CONFIG, **(config or {})}
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    mlp_row_kernel[(triton.cdiv(I, cfg["BLOCK_I"]),)](
        x, residual, new_residual, norm_weight, gate_up_weight, down_weight, out, zeroed_sums(x.device, H),
        split_counters(x.device, 1), H, I, eps, gate_up_weight.stride(0), down_weight.stride(0),
        BLOCK_I=cfg["BLOCK_I"], BLOCK_K=min(cfg["BLOCK_K"], triton.next_power_of_2(H)),
        BLOCK_H=min(cfg["BLOCK_H"], triton.next_power_of_2(H)), ROW=triton.next_power_of_2(H), HAS_RESIDUAL=True,
        PDL=pdl, num_warps=cfg["num_warps"], **launch_options(pdl))
    return out, new_residual


CONFIGS = ({}, {"BLOCK_I": 8}, {"BLOCK_I": 32, "BLOCK_K": 256}, {"BLOCK_K": 256, "num_warps": 4},
           {"BLOCK_I": 8, "num_warps": 4}, {"BLOCK_I": 8, "BLOCK_K": 1024}, {"BLOCK_H": 128}, {"BLOCK_H": 512})


@triton.jit
def grid_barrier(count_ptr, gen_ptr):
    """Wait until every program of the grid has arrived: the last to arrive zeroes the count and advances the
    generation, the others spin until it moves (every program must be resident)."""
    gen = tl.atomic_add(gen_ptr, 0, sem="acquire")
    tl.debug_barrier()                                   # this program's writes, before it arrives
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.atomic_xchg(count_ptr, 0)
        tl.atomic_add(gen_ptr, 1, sem="release")
    else:
        while tl.atomic_add(gen_ptr, 0, sem="acquire") == gen:
            pass
    tl.debug_barrier()


@triton.jit
def mlp_barrier_kernel(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, gate_up_ptr, down_ptr, act_ptr, out_ptr, bar_ptr,
                       H, I, eps, stride_gu, stride_down, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOWN_K: tl.constexpr, ROW: tl.constexpr, PDL: tl.constexpr):
    pdl_launch_next(PDL)
    pid, P = tl.program_id(0), tl.num_programs(0)
    for blk in range(pid, tl.cdiv(I, BLOCK_I), P):       # phase 1: silu(gate) * up, BLOCK_I rows at a time
        rows = blk * BLOCK_I + tl.arange(0, BLOCK_I)
        act = _mlp_act(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, gate_up_ptr, rows, H, I, eps, stride_gu,
                       (pid == 0) & (blk == pid), BLOCK_K, ROW, True, PDL)
        tl.store(act_ptr + rows, act.to(act_ptr.dtype.element_ty), mask=rows < I)
    grid_barrier(bar_ptr, bar_ptr + 1)
    for blk in range(pid, tl.cdiv(H, BLOCK_N), P):       # phase 2: the down projection, BLOCK_N outputs whole
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N, DOWN_K], tl.float32)
        for k0 in range(0, I, DOWN_K):
            kk = k0 + tl.arange(0, DOWN_K)
            acc += (_gemv_weights(down_ptr, offs_n, kk, H, I, stride_down, False)
                    * tl.load(act_ptr + kk, mask=kk < I, other=0.0, cache_modifier=".cg").to(tl.float32)[None, :])
        tl.store(out_ptr + offs_n, sum_last(acc, 1).to(out_ptr.dtype.element_ty), mask=offs_n < H)


BARRIER_WORDS: dict = {}        # device -> the barrier's count and generation (its own: the generation never returns
                                # to zero, so it cannot share the merge counters, which every launch leaves zero)


def mlp_barrier(x, r, nw, gu, dw, pdl: bool, programs: int):
    "The barrier variant's launch: `programs` programs (all resident at once), the activation row through memory."
    H, I = x.shape[1], dw.shape[1]
    if x.device not in BARRIER_WORDS: BARRIER_WORDS[x.device] = torch.zeros(2, dtype=torch.int32, device=x.device)
    words = BARRIER_WORDS[x.device]
    act, out, new_r = torch.empty(1, I, dtype=x.dtype, device=x.device), torch.empty_like(x), torch.empty_like(x)
    mlp_barrier_kernel[(programs,)](x, r, new_r, nw, gu, dw, act, out, words, H, I, 1e-6,
                                    gu.stride(0), dw.stride(0), BLOCK_I=16, BLOCK_K=512, BLOCK_N=8, DOWN_K=512,
                                    ROW=triton.next_power_of_2(H), PDL=pdl, num_warps=8, **launch_options(pdl))
    return out, new_r


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
    if smoke:                               # fp32: the one launch against the torch path of the two
        want = mlp_row_ref(x, r, nw, 1e-6, *ws[0])[0]
        assert max_rel_err(mlp_row(x, r, nw, 1e-6, *ws[0], config={"BLOCK_I": 8, "BLOCK_K": 32, "BLOCK_H": 16})[0],
                           want) < 1e-5
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
    programs = 1 if smoke else num_sms(device)
    out, new_r = mlp_barrier(x, r, nw, *ws[0], pdl, programs)
    err = max_rel_err(out, ref)
    assert torch.equal(new_r, ref_r) and err < 2e-2, (shape, "barrier", err)
    us = graph_bench(lambda i: (lambda: mlp_barrier(x, r, nw, *ws[i % len(ws)], pdl, programs)), nbytes, device=device)
    row["barrier"] = {"programs": programs, "us": us, "disagree": disagree(*us) if len(us) > 1 else False,
                      "max_rel_err": err}
    print(shape, "barrier", [round(u, 2) for u in us], flush=True)
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

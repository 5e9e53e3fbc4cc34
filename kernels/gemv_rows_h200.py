"""A GEMV over 1-8 rows (`gemv_rows`: the fused-kernels chapter's `gemv` loop with each weight tile multiplied into
every row) against what the engine runs at those rows now: cuBLAS (`F.linear`; for the down projection `silu_mul`
first), and at one row `gemv` itself. A lead for speculative verify steps (a verify row of 1 + k is k + 1 rows of one
sequence) and decode steps of 2-8 sequences, bound by reading the weights like one row.

    PYTHONPATH=. python kernels/gemv_rows_h200.py --out figures/data [--parts count,check,time,dot] [--rows 1,2,5,8]

Parts, in the tutorials' order:
- count: each layer of the 0.5B and 7B shapes at each row count compiled for sm_90 (Triton's own ptxas; runs on any
  machine, no GPU needed): registers a thread, stack bytes (spills), the main loop's instructions per weight;
  beside them `gemv` at one row.
`gemv_rows_kernel` keeps `[BLOCK_M, BLOCK_N, BLOCK_K]` fp32 sums (BLOCK_M = the rows rounded up to a power of two,
BLOCK_M x BLOCK_K = 512, so the sums take the registers one row's 512-wide tile would), reduced once after the loop;
SiLU x up made as the inputs load; split-K merged by the last split (`finish_split`), as `gemv`.
- check: `gemv_rows` in bf16 against the torch product of the same rows (`lab.rel_err` under 2%; a wrong one stops
  the run).
- time: µs a call, `lab.graph_bench` (CUDA graphs over copies of the weights that overflow L2, two passes, flagged
  when they disagree by more than 15%), `gemv_rows` and cuBLAS interleaved per case, `gemv` at one row beside them.
- dot: `gemm_rows`, the same loop with the products on the tensor cores (`tl.dot` of 16 rows, padded, by each
  weight tile, loaded in bf16), in each of `GEMM_ROWS_CONFIGS` against cuBLAS at `--dot-rows`, `gemv` at one row
  beside them as the floor to reach (the weights read once for every row); for the QKV and gate/up layers also with
  the norm made inside against `add_rmsnorm` + cuBLAS. Timed on an H100 (`gemm_rows_h100.json`): slower than cuBLAS
  in every product but the 7B gate/up, the made norm slower still; it was in the package for a session as
  `KernelConfig.rows_gemv` and was taken back (the fused chapter's table).
The speculative chapter's notes predict the 7B verify step from these: a verify row of 1 + 4 is 5 rows.
`--smoke`: fp32, one tiny layer, under the interpreter (check and time; count needs the compiler).
"""
import sys; from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))      # the only sys.path use in the lab
from lab import (device_or_skip, disagree, disassemble, graph_bench, is_smoke, main_loop, median, parser,  # noqa: E402
                 rel_err, run_parts, saver)

import torch                                                                             # noqa: E402
import torch.nn.functional as F                                                          # noqa: E402
import triton                                                                            # noqa: E402
import triton.language as tl                                                             # noqa: E402

from nanoserve.fused import (_gemv_weights, _normed, add_rmsnorm, add_rmsnorm_ref, gemv,  # noqa: E402
                             gemv_config, gemv_rule, silu_mul)
from nanoserve.runtime import (finish_split, launch_options, num_sms, pdl_launch_next, pdl_wait,  # noqa: E402
                               split_counters, sum_last)

NAME = "gemv_rows_h200.json"
LAYERS = {"0.5B": {"qkv_proj": (1152, 896, False), "o_proj": (896, 896, False), "gate_up_proj": (9728, 896, False),
                   "down_proj": (896, 4864, True)},
          "7B": {"qkv_proj": (4608, 3584, False), "o_proj": (3584, 3584, False), "gate_up_proj": (37888, 3584, False),
                 "down_proj": (3584, 18944, True)}}
SMOKE_LAYERS = {"tiny": {"down_proj": (64, 256, True), "qkv_proj": (48, 128, False)}}
NORM_FED = ("qkv_proj", "gate_up_proj")         # the layers whose input is an RMSNorm's output


@triton.jit
def _rows_inputs(x_ptr, offs_m, kk, M, K, stride_xm, ACT: tl.constexpr):
    """The `[BLOCK_M, BLOCK_K]` inputs of rows `offs_m` in fp32 (zeros past M and K); with `ACT`, silu(gate) * up of
    the `[M, 2K]` rows, rounded as `silu_mul` rounds."""
    mask = (offs_m < M)[:, None] & (kk < K)[None, :]
    ptrs = x_ptr + offs_m[:, None] * stride_xm + kk[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if ACT:                                   # x is the gate
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = (x / (1.0 + tl.exp(-x))).to(x_ptr.dtype.element_ty).to(tl.float32)
        x = (x * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    return x

@triton.jit
def _program_tiles(tiles_per_split, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    "A program's (channel block, split) ids, row / channel / K offsets, its K tiles' range and first tile's columns."
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m, offs_n, k = tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, (K + BLOCK_K - 1) // BLOCK_K)
    return pid_n, pid_k, offs_m, offs_n, k, t_begin, t_end, t_begin * BLOCK_K + k    # every split has a tile


@triton.jit
def gemv_rows_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, K, tiles_per_split, stride_xm,
                     stride_wn, stride_om, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_launch_next(PDL)
    pid_n, pid_k, offs_m, offs_n, k, t_begin, t_end, kk = _program_tiles(tiles_per_split, K, BLOCK_M, BLOCK_N, BLOCK_K)
    w = _gemv_weights(w_ptr, offs_n, kk, N, K, stride_wn, EVEN)                    # [BLOCK_N, BLOCK_K]
    pdl_wait(PDL)                               # the first weight tile is in flight; the inputs are not ready before
    acc = _rows_inputs(x_ptr, offs_m, kk, M, K, stride_xm, ACT)[:, None, :] * w[None, :, :]   # [BM, BN, BK]
    for t in range(t_begin + 1, t_end):
        kk = t * BLOCK_K + k
        acc += (_rows_inputs(x_ptr, offs_m, kk, M, K, stride_xm, ACT)[:, None, :]
                * _gemv_weights(w_ptr, offs_n, kk, N, K, stride_wn, EVEN)[None, :, :])
    finish_split(sum_last(acc, 2), bias_ptr, out_ptr, part_ptr, counter_ptr, offs_m, offs_n, M, N, stride_om, pid_n,
                 pid_k, tl.num_programs(1), HAS_BIAS, SPLIT)

@triton.jit
def _weight_tile(w_ptr, offs_n, kk, N, K, stride_wn, EVEN: tl.constexpr):
    "One `[BLOCK_N, BLOCK_K]` weight tile in its own dtype (the tensor cores take it as it is)."
    if EVEN:
        return tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :])
    return tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :], mask=(offs_n < N)[:, None] & (kk < K)[None, :],
                   other=0.0)


@triton.jit
def _rows_rstd(x_ptr, res_ptr, offs_m, M, K, stride_xm, eps, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    "`[BLOCK_M]` 1 / RMS of rows `offs_m` of x (+ res, rounded as `add_rmsnorm` rounds), K in `BLOCK_K` chunks."
    ss = tl.zeros((offs_m.shape[0],), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_m < M)[:, None] & (kk < K)[None, :]
        rows = offs_m[:, None] * stride_xm + kk[None, :]
        v = tl.load(x_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            v = (v + tl.load(res_ptr + rows, mask=mask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            v = v.to(tl.float32)
        ss += tl.sum(v * v, 1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _made_rows(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, offs_m, kk, M, K, stride_xm, rstd, store,
               ACT: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """`[BLOCK_M, BLOCK_K]` fp32 inputs: `_rows_inputs`, or with `NORM` the rows (+ res; where `store`, the sum
    written to `new_res`) normalised by `rstd` and times the norm's weight, as `add_rmsnorm` computes them."""
    if NORM:
        mask = (offs_m < M)[:, None] & (kk < K)[None, :]
        rows = offs_m[:, None] * stride_xm + kk[None, :]
        x = tl.load(x_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        r = x
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows, mask=mask, other=0.0).to(tl.float32)
            tl.store(new_res_ptr + rows, (x + r).to(x_ptr.dtype.element_ty), mask=mask & store)
        nw = tl.load(norm_w_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        return _normed(x, r, nw[None, :], rstd[:, None], x_ptr.dtype.element_ty, HAS_RESIDUAL)
    return _rows_inputs(x_ptr, offs_m, kk, M, K, stride_xm, ACT)


@triton.jit
def gemm_rows_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, K, tiles_per_split, stride_xm,
                     stride_wn, stride_om, res_ptr, new_res_ptr, norm_w_ptr, eps,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
                     NORM: tl.constexpr = False, HAS_RESIDUAL: tl.constexpr = False, PDL: tl.constexpr = False):
    """`gemv_rows_kernel`'s loop with the products on the tensor cores: `tl.dot` of 16 rows (padded) by a weight tile;
    with `NORM`, each program normalises the rows it takes (their 1 / RMS over the whole K first)."""
    pdl_launch_next(PDL)
    pid_n, pid_k, offs_m, offs_n, k, t_begin, t_end, kk = _program_tiles(tiles_per_split, K, BLOCK_M, BLOCK_N, BLOCK_K)
    w = _weight_tile(w_ptr, offs_n, kk, N, K, stride_wn, EVEN)                     # [BLOCK_N, BLOCK_K]
    pdl_wait(PDL)                               # the first weight tile is in flight; the inputs are not ready before
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    if NORM:
        rstd = _rows_rstd(x_ptr, res_ptr, offs_m, M, K, stride_xm, eps, BLOCK_K, HAS_RESIDUAL)      # [BLOCK_M]
    store = pid_n == 0                          # the first column of programs writes the new residual
    x = _made_rows(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, offs_m, kk, M, K, stride_xm, rstd, store, ACT, NORM,
                   HAS_RESIDUAL)
    acc = tl.dot(x.to(w_ptr.dtype.element_ty), tl.trans(w))                                   # [BLOCK_M, BLOCK_N]
    for t in range(t_begin + 1, t_end):
        kk = t * BLOCK_K + k
        x = _made_rows(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, offs_m, kk, M, K, stride_xm, rstd, store, ACT,
                       NORM, HAS_RESIDUAL)
        acc += tl.dot(x.to(w_ptr.dtype.element_ty), tl.trans(_weight_tile(w_ptr, offs_n, kk, N, K, stride_wn, EVEN)))
    finish_split(acc, bias_ptr, out_ptr, part_ptr, counter_ptr, offs_m, offs_n, M, N, stride_om, pid_n,
                 pid_k, tl.num_programs(1), HAS_BIAS, SPLIT)


GEMM_ROWS_CONFIGS = ({"BLOCK_N": 32, "BLOCK_K": 128}, {"BLOCK_N": 64, "BLOCK_K": 128}, {"BLOCK_N": 32, "BLOCK_K": 256},
                     {"BLOCK_N": 64, "BLOCK_K": 256}, {"BLOCK_N": 128, "BLOCK_K": 128}, {"BLOCK_N": 16, "BLOCK_K": 256})
GEMM_MAX_ROWS = 16                               # one `tl.dot` of 16 rows: the tensor cores' smallest M


def gemm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: bool = False,
              config: dict | None = None, pdl: bool = False, norm: tuple | None = None,
              residual: torch.Tensor | None = None):
    """`gemv_rows` on the tensor cores: `x` [M, K] (M <= 16) @ `weight`.T [N, K] (+ `bias`) -> [M, N]. With `norm`
    = (weight [K], eps): RMSNorm of x (+ `residual`) made inside, `(out, new residual)` returned, as `gemv`'s."""
    (M, width), (N, K) = x.shape, weight.shape
    if not 1 <= M <= GEMM_MAX_ROWS or width != (2 * K if act else K) or (act and norm is not None):
        raise ValueError(f"gemm_rows: expected x of shape (1..{GEMM_MAX_ROWS}, {2 * K if act else K}), "
                         f"got {tuple(x.shape)}" + (" with both act and norm" if act and norm is not None else ""))
    cfg = {**gemv_rule(N, K, num_sms(x.device), {**GEMM_ROWS_CONFIGS[1], **(config or {})}), "BLOCK_M": 16}
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else x                                  # [M, K]
    split, n_tiles = cfg["SPLIT_K"] > 1, triton.cdiv(N, cfg["BLOCK_N"])
    part = torch.empty(cfg["SPLIT_K"], M, N, dtype=torch.float32, device=x.device) if split else out   # [S, M, N]
    counters = split_counters(x.device, n_tiles) if split else out
    gemm_rows_kernel[(n_tiles, cfg["SPLIT_K"])](
        x, weight, bias if bias is not None else weight, out, part, counters, M, N, K, cfg["tiles_per_split"],
        x.stride(0), weight.stride(0), out.stride(0), residual if residual is not None else x, new_residual,
        norm[0] if norm is not None else x, norm[1] if norm is not None else 0.0,
        HAS_BIAS=bias is not None, ACT=act, BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT=split,
        EVEN=N % cfg["BLOCK_N"] == 0 and K % cfg["BLOCK_K"] == 0, NORM=norm is not None,
        HAS_RESIDUAL=residual is not None, PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(pdl))
    return out if norm is None else (out, new_residual)


GEMV_MAX_ROWS = 8                                # rows `gemv_rows` takes (beyond: a GEMM's tiles)


def gemv_rows_config(M: int, N: int, K: int, sms: int, config: dict | None = None) -> dict:
    "`gemv_rule`'s blocks and split with `BLOCK_M` = M rounded up to a power of two and `BLOCK_M x BLOCK_K` = 512."
    block_m = triton.next_power_of_2(M)
    return {**gemv_rule(N, K, sms, {"BLOCK_K": max(64, 512 // block_m), **(config or {})}), "BLOCK_M": block_m}


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: bool = False,
              config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    "`x` [M, K] (M <= `GEMV_MAX_ROWS`) @ `weight`.T [N, K] (+ `bias`) -> [M, N]; with `act`, x is [M, 2K] (as `gemv`)."
    (M, width), (N, K) = x.shape, weight.shape
    if not 1 <= M <= GEMV_MAX_ROWS or width != (2 * K if act else K):
        raise ValueError(f"gemv_rows: expected x of shape (1..{GEMV_MAX_ROWS}, {2 * K if act else K}), "
                         f"got {tuple(x.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gemv_rows: x and weight must be contiguous along K")
    cfg = gemv_rows_config(M, N, K, num_sms(x.device), config)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    split, n_tiles = cfg["SPLIT_K"] > 1, triton.cdiv(N, cfg["BLOCK_N"])
    part = torch.empty(cfg["SPLIT_K"], M, N, dtype=torch.float32, device=x.device) if split else out   # [S, M, N]
    counters = split_counters(x.device, n_tiles) if split else out
    gemv_rows_kernel[(n_tiles, cfg["SPLIT_K"])](
        x, weight, bias if bias is not None else weight, out, part, counters, M, N, K, cfg["tiles_per_split"],
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, ACT=act, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT=split,
        EVEN=N % cfg["BLOCK_N"] == 0 and K % cfg["BLOCK_K"] == 0, PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(pdl))
    return out


def layers(args) -> list[tuple]:
    "(shape, layer, N, K, act) of every case."
    return [(s, name, *v) for s, ls in (SMOKE_LAYERS if is_smoke(args) else LAYERS).items() for name, v in ls.items()]


def compile_rows(M: int, N: int, K: int, act: bool):
    "`gemv_rows_kernel` as `gemv_rows` would launch it in bf16 (M rows; one row: `gemv_kernel`), compiled for sm_90."
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import nanoserve.fused as Fu
    rows = M > 1
    cfg = gemv_rows_config(M, N, K, 132) if rows else gemv_config(N, K, 132)
    kernel = gemv_rows_kernel if rows else Fu.gemv_kernel
    split = cfg["SPLIT_K"] > 1
    consts = dict(HAS_BIAS=False, ACT=act, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT=split,
                  EVEN=N % cfg["BLOCK_N"] == 0 and K % cfg["BLOCK_K"] == 0, PDL=True)
    consts.update(BLOCK_M=cfg["BLOCK_M"]) if rows else consts.update(NORM=False, HAS_RESIDUAL=False, ROW=1,
                                                                        HAS_SCALE=False)
    sig, cst = {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in consts: sig[n] = "constexpr"; cst[(i,)] = consts[n]
        elif n.endswith("_ptr"): sig[n] = "*fp32" if n == "part_ptr" else ("*i32" if n == "counter_ptr" else "*bf16")
        else: sig[n] = "fp32" if n == "eps" else "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=cst)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}), cfg


def count(res, args) -> None:
    rows_out = res.setdefault("count", [])
    for shape, name, N, K, act in layers(args):
        for M in args.rows:
            compiled, cfg = compile_rows(M, N, K, act)
            sass, usage = disassemble(compiled.asm["cubin"])
            loop, _ = main_loop(sass)
            per_trip = cfg.get("BLOCK_M", 1) * cfg["BLOCK_N"] * cfg["BLOCK_K"] // (32 * cfg["num_warps"])
            row = {"shape": shape, "layer": name, "N": N, "K": K, "rows": M,
                   "kernel": "gemv_rows" if M > 1 else "gemv",
                   "config": {k: cfg.get(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")},
                   "registers": usage["REG"], "stack_bytes": usage.get("STACK", 0),
                   "loop_instructions": len(loop), "products_per_thread_per_trip": per_trip,
                   "loop_instructions_per_weight": len(loop) * cfg.get("BLOCK_M", 1) / per_trip}
            rows_out.append(row)
            print(f"{shape} {name} x{M}: {row['registers']} registers, {row['stack_bytes']} B stack, "
                  f"{row['loop_instructions_per_weight']:.2f} loop instructions a weight", flush=True)


def operands(N: int, K: int, M: int, act: bool, device, dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.02).to(device=device, dtype=dtype)
    x = torch.randn(M, 2 * K if act else K, generator=g).to(device=device, dtype=dtype)
    return x, w


def cublas(x, w, act):
    "What the engine runs at 2-8 rows now: `silu_mul` (the down projection) and cuBLAS's product."
    return F.linear(silu_mul(x) if act else x, w)


def check(res, args, device, dtype) -> None:
    out = res.setdefault("check", [])
    x, w = operands(40, 96, 3, False, device, torch.float32)                  # fits no block: masked tails
    assert rel_err(gemv_rows(x, w, config={"BLOCK_N": 16, "SPLIT_K": 3}), F.linear(x, w)) < 1e-5
    for shape, name, N, K, act in layers(args):
        for M in args.rows:
            x, w = operands(N, K, M, act, device, dtype)
            err = rel_err(gemv_rows(x, w, act=act), cublas(x, w, act))
            out.append({"shape": shape, "layer": name, "rows": M, "rel_err": err})
            assert err < 0.02, (shape, name, M, err)
    print("check:", max(r["rel_err"] for r in out), "largest relative error", flush=True)
    x, w = operands(40, 96, 3, True, device, torch.float32)                   # masked tails, SiLU x up, split
    assert rel_err(gemm_rows(x, w, act=True, config={"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3}),
                   cublas(x, w, True)) < 1e-2
    for shape, name, N, K, act in layers(args):
        for M in args.dot_rows:
            x, w = operands(N, K, M, act, device, dtype)
            for cfg in GEMM_ROWS_CONFIGS[:1] if is_smoke(args) else GEMM_ROWS_CONFIGS:
                err = rel_err(gemm_rows(x, w, act=act, config=cfg), cublas(x, w, act))
                out.append({"shape": shape, "layer": name, "rows": M, "kernel": "gemm_rows", "config": cfg,
                            "rel_err": err})
                assert err < 0.02, (shape, name, M, cfg, err)
    x, w = operands(40, 96, 3, False, device, torch.float32)                  # the norm made inside, split
    r, nw = torch.randn_like(x), 1.0 + 0.1 * torch.randn(96, device=device)
    got, got_res = gemm_rows(x, w, config={"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3}, norm=(nw, 1e-6), residual=r)
    want, want_res = made_ref(x, w, nw, r)
    assert rel_err(got, want) < 1e-5 and torch.equal(got_res, want_res)
    print("check gemm_rows:", max(r["rel_err"] for r in out if r.get("kernel")), "largest relative error", flush=True)


def made_ref(x, w, nw, r, eps: float = 1e-6):
    "What the engine runs before a verify step's norm-fed products now: `add_rmsnorm`, then cuBLAS's product."
    h, res = add_rmsnorm(x, r, nw, eps) if x.is_cuda else add_rmsnorm_ref(x, r, nw, eps)
    return F.linear(h, w), res


def time_dot(res, args, device, dtype) -> None:
    "`gemm_rows` in each configuration against cuBLAS at `--dot-rows`, with `gemv` at one row as the floor to beat."
    out = res.setdefault("dot", [])
    for shape, name, N, K, act in layers(args):
        nbytes = N * K * torch.finfo(dtype).bits // 8
        x1, w = operands(N, K, 1, act, device, dtype)
        one_row = median(graph_bench(lambda i: (lambda: gemv(x1, w, act=act)), nbytes, device=device))
        for M in args.dot_rows:
            x, w = operands(N, K, M, act, device, dtype)
            calls = {"cuBLAS": lambda i: (lambda: cublas(x, w, act))}
            for j, cfg in enumerate(GEMM_ROWS_CONFIGS[:1] if is_smoke(args) else GEMM_ROWS_CONFIGS):
                calls[f"gemm_rows {cfg['BLOCK_N']}x{cfg['BLOCK_K']} {j}"] = lambda i, cfg=cfg: (
                    lambda: gemm_rows(x, w, act=act, config=cfg))
            us = {k: graph_bench(c, nbytes, device=device) for k, c in calls.items()}
            best = min((k for k in us if k != "cuBLAS"), key=lambda k: median(us[k]))
            row = {"shape": shape, "layer": name, "rows": M, "us": us, "gemv_one_row_us": one_row, "best": best,
                   "disagree": any(disagree(*v) for v in us.values() if len(v) > 1),
                   "best_over_cublas": median(us[best]) / median(us["cuBLAS"]),
                   "best_over_one_row": median(us[best]) / one_row}
            if name in NORM_FED:                      # the norm made inside against the norm kernel + cuBLAS
                r, nw = torch.randn_like(x), torch.ones(K, device=device, dtype=dtype)
                cfg = GEMM_ROWS_CONFIGS[int(best.split()[-1])]
                made = {"norm + cuBLAS": lambda i: (lambda: made_ref(x, w, nw, r)),
                        "gemm_rows, norm made": lambda i: (lambda: gemm_rows(x, w, config=cfg, norm=(nw, 1e-6),
                                                                             residual=r))}
                row["made_us"] = {k: graph_bench(c, nbytes, device=device) for k, c in made.items()}
                row["made_over_apart"] = (median(row["made_us"]["gemm_rows, norm made"])
                                          / median(row["made_us"]["norm + cuBLAS"]))
            out.append(row)
            print(f"{shape} {name} x{M}: {best} {median(us[best]):.1f} us, cuBLAS {median(us['cuBLAS']):.1f}, "
                  f"gemv at one row {one_row:.1f} ({row['best_over_cublas']:.2f}x cuBLAS)"
                  + (f"; norm made {row['made_over_apart']:.2f}x norm + cuBLAS" if "made_us" in row else ""),
                  flush=True)


def time_rows(res, args, device, dtype) -> None:
    out = res.setdefault("time", [])
    for shape, name, N, K, act in layers(args):
        nbytes = N * K * torch.finfo(dtype).bits // 8
        for M in args.rows:
            x, w = operands(N, K, M, act, device, dtype)
            calls = {"gemv_rows": lambda i, x=x, w=w: (lambda: gemv_rows(x, w, act=act)),
                     "cuBLAS": lambda i, x=x, w=w: (lambda: cublas(x, w, act))}
            if M == 1: calls["gemv"] = lambda i, x=x, w=w: (lambda: gemv(x, w, act=act))
            us = {k: graph_bench(c, nbytes, device=device) for k, c in calls.items()}
            flagged = any(disagree(*v) for v in us.values() if len(v) > 1)
            row = {"shape": shape, "layer": name, "rows": M, "us": us, "disagree": flagged,
                   "rows_over_cublas": median(us["gemv_rows"]) / median(us["cuBLAS"])}
            out.append(row)
            print(f"{shape} {name} x{M}: gemv_rows {median(us['gemv_rows']):.1f} us, "
                  f"cuBLAS {median(us['cuBLAS']):.1f}"
                  + (f", gemv {median(us['gemv']):.1f}" if M == 1 else "") + f" ({row['rows_over_cublas']:.2f}x)",
                  flush=True)


def main():
    ap = parser(__doc__, parts="count,check,time,dot")
    ap.add_argument("--rows", default="1,2,3,5,8", help="row counts, comma-separated (1-8)")
    ap.add_argument("--dot-rows", default="5,9,16", help="`gemm_rows`'s row counts, comma-separated (1-16)")
    args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    args.dot_rows = [int(r) for r in args.dot_rows.split(",")]
    smoke = is_smoke(args)
    parts_asked = set(args.parts.split(","))
    if smoke:                                   # under the interpreter there is no compiler to count with
        parts_asked.discard("count")
        args.parts = ",".join(p for p in args.parts.split(",") if p != "count")
    device = torch.device("cpu") if parts_asked == {"count"} else device_or_skip(args)
    dtype = torch.float32 if smoke else torch.bfloat16
    res = {"what": "gemv_rows and gemm_rows (the tensor cores) against cuBLAS (and gemv at one row), bf16"}
    parts = {"count": lambda: count(res, args), "check": lambda: check(res, args, device, dtype),
             "time": lambda: time_rows(res, args, device, dtype), "dot": lambda: time_dot(res, args, device, dtype)}
    run_parts(parts, args.parts, saver(NAME, res, args))


if __name__ == "__main__":
    main()

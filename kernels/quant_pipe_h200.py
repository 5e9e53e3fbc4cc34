"""The one-row INT4 GEMV's loads in flight: does hiding its load latency close the gap to the copy speed?

Run on the device machine from the repo root:
    PYTHONPATH=. python kernels/quant_pipe_h200.py --out $OUT [--parts pipe,package,narrow,perm]
Writes quant_pipe_h200.json (run metadata inside) after every projection.

Parts: pipe, the lab kernel's load placements (and the tiled layout: TILED, SG) against the shipped kernel; package
and narrow, the package's own `quant_gemv` on `tile_int4`'s layout swept over blocks, warps, splits (and register
caps), per 7B projection and the 7B LM head; perm, the lab kernel on the package's final layout (PERM: its nibble
order), its loop against Triton's pipeline.

The shipped INT4 words path (`HALF2` + `SHIFT`: nibbles and activations in packed bf16 pairs, the zero point
inside the pairs) prefetches the next group's weight words, but loads each group's scales, zero points and
activations in the iteration that uses them, and its zero points reach the words' layout through shared memory
(two barriers a trip). Nsight Compute found its warps waiting on loads, 1.1 eligible a scheduler. `pipe_int4_kernel`
keeps the arithmetic and changes where the loads are:

- MODE 0: everything the next group needs (words, scales, zero-point pairs, and with XPF its activation pairs) is
  loaded at the top of this group's iteration, into registers; DEPTH 2 keeps two groups in flight.
- MODE 1: the loop loads what it uses, and Triton's software pipeline (`tl.range(..., num_stages=STAGES)`) turns
  the loads into asynchronous copies into shared memory, STAGES - 1 groups ahead.
- ZFMT 1: the zero points stored as the ready int32 pair -(128 + z), -(128 + z) (4 bytes a group, not 1), so no
  byte load, no shift and no or in the loop; SG: scales and zero points stored [groups, N] (a program's channels
  contiguous: one coalesced load a group) instead of [N, groups].

Each variant is checked against `quant_matmul_ref` (2%, asserted) and timed by `graph_bench` against the shipped
kernel (`quant_matmul`, the package's table, PDL on) in the same run; the package's own kernel is swept through
`config=` per call. `--smoke`: each part on one tiny layer, a candidate or two, on the CPU under the interpreter.
"""
import sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (best_trial, checked, device_or_skip, exit_if_failed, graph_bench, is_smoke, layer_shapes, max_rel_err,
                 operand_copies, parser, run_parts, saver, tensor_bytes, trial_row, write)

import torch
import triton
import triton.language as tl

from nanoserve.quant import (NIBBLES, PAIRS_ASM_SHIFT, _pairs_emulated, _x_pairs, _x_words, gemv_tile, pack_int4,
                             quant_gemv, quant_matmul, quant_matmul_ref, quant_tables, quantize_int4, tile_int4,
                             unpack_int4)
from nanoserve.runtime import (finish_split, launch_options, pdl_launch_next, pdl_wait, split_counters, split_tiles,
                               sum_last)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # the CPU under --smoke (lab hides GPUs)
EMULATE = DEVICE.type != "cuda"           # the interpreter runs the package's stand-in for the packed pairs' PTX
TINY = [("down_proj", 256, 1024, False)]                                 # --smoke's layer
SMOKE_SHIPPED = {"BLOCK_N": 64, "num_warps": 4, "SPLIT_K": 2}            # a stand-in table entry for it


def layer_case(N: int, K: int):
    """One INT4 projection at one row: bf16 weight, input, its quantized form (groups of 128), its bytes, copies for
    graph_bench, and the fp32 reference output."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16, generator=g) * 0.02
    x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16, generator=g)
    q = quantize_int4(w, 128)
    qb = tensor_bytes(q)
    return w, x, q, qb, operand_copies(q, qb), quant_matmul_ref(x.float(), *q, None, "int4", 128)


@triton.jit
def _zpair(z_ptr, ZFMT: tl.constexpr):
    "The int32 pair -(128 + z), -(128 + z) in bf16 bits, from a byte z (ZFMT 0) or stored ready (ZFMT 1)."
    if ZFMT == 1:
        return tl.load(z_ptr)
    zb = tl.load(z_ptr).to(tl.int32) | 0xC300
    return zb | (zb << 16)


@triton.jit
def _group_dot(x_ptr, t, words, s, zp, ASM: tl.constexpr, GROUP: tl.constexpr, EMULATE: tl.constexpr,
               p0, p1, p2, p3, XPF: tl.constexpr, PERM: tl.constexpr = False):
    """One group's sum of s (q - z) x per word [BLOCK_N, NW] (activation pairs loaded here unless XPF gave them;
    PERM: the words' nibbles in the package's pair order, so the pairs are x's own int32 words)."""
    NW: tl.constexpr = GROUP // 8
    if not XPF:
        if PERM:
            p0, p1, p2, p3 = _x_words(x_ptr, t * (GROUP // 2), NW)
        else:
            p0, p1, p2, p3 = _x_pairs(x_ptr, t * (GROUP // 2), NW)
    zp2 = zp[:, None]
    if EMULATE:
        dot = _pairs_emulated(words, p0[None, :], p1[None, :], p2[None, :], p3[None, :], zp2)
    else:
        dot = tl.inline_asm_elementwise(ASM, "=f,r,r,r,r,r,r",
                                        [words, p0[None, :], p1[None, :], p2[None, :], p3[None, :], zp2],
                                        dtype=tl.float32, is_pure=True, pack=1)         # [BLOCK_N, NW]
    return dot * s[:, None]


@triton.jit
def pipe_int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, counter_ptr, N, K, tiles_per_split,
                     stride_wb, stride_wn, stride_wg, stride_sn, stride_sg, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     SPLIT: tl.constexpr, ASM: tl.constexpr, MODE: tl.constexpr, STAGES: tl.constexpr,
                     DEPTH: tl.constexpr, XPF: tl.constexpr, ZFMT: tl.constexpr, PDL: tl.constexpr,
                     EMULATE: tl.constexpr, PERM: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NW: tl.constexpr = GROUP // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, NW)
    # [BLOCK_N, NW]: group 0's words; row-major [N, K / 8] or, TILED, [N / BLOCK_N, groups, BLOCK_N, NW]
    wp = w_ptr + pid_n * stride_wb + tl.arange(0, BLOCK_N)[:, None] * stride_wn + j[None, :]
    sp = s_ptr + offs_n * stride_sn                                           # [BLOCK_N]: group 0's scales
    zq = z_ptr + offs_n * stride_sn
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, K // GROUP)
    total = tl.full([BLOCK_N, NW], 0.0, tl.float32)
    if MODE == 0:
        words = tl.load(wp + t_begin * stride_wg)                            # weights only before the wait
        s = tl.load(sp + t_begin * stride_sg)
        zp = _zpair(zq + t_begin * stride_sg, ZFMT)
        if DEPTH == 2:
            t1 = tl.minimum(t_begin + 1, t_end - 1)
            words1 = tl.load(wp + t1 * stride_wg)
            s1 = tl.load(sp + t1 * stride_sg)
            zp1 = _zpair(zq + t1 * stride_sg, ZFMT)
        pdl_wait(PDL)
        p0, p1, p2, p3 = _x_pairs(x_ptr, t_begin * (GROUP // 2), NW)
        for t in range(t_begin, t_end):
            tn = tl.minimum(t + DEPTH, t_end - 1)                             # DEPTH groups ahead (the last again)
            words_n = tl.load(wp + tn * stride_wg)
            s_n = tl.load(sp + tn * stride_sg)
            zp_n = _zpair(zq + tn * stride_sg, ZFMT)
            if XPF:
                q0, q1, q2, q3 = _x_pairs(x_ptr, tl.minimum(t + 1, t_end - 1) * (GROUP // 2), NW)
            total += _group_dot(x_ptr, t, words, s, zp, ASM, GROUP, EMULATE, p0, p1, p2, p3, XPF, PERM)
            if DEPTH == 2:
                words, s, zp = words1, s1, zp1
                words1, s1, zp1 = words_n, s_n, zp_n
            else:
                words, s, zp = words_n, s_n, zp_n
            if XPF:
                p0, p1, p2, p3 = q0, q1, q2, q3
    elif MODE == 2:                           # the shipped placement: only the words one group ahead
        words = tl.load(wp + t_begin * stride_wg)
        pdl_wait(PDL)
        p0, p1, p2, p3 = _x_pairs(x_ptr, t_begin * (GROUP // 2), NW)         # (unused: XPF is off here)
        for t in range(t_begin, t_end):
            s = tl.load(sp + t * stride_sg)
            zp = _zpair(zq + t * stride_sg, ZFMT)
            total += _group_dot(x_ptr, t, words, s, zp, ASM, GROUP, EMULATE, p0, p1, p2, p3, False, PERM)
            words = tl.load(wp + tl.minimum(t + 1, t_end - 1) * stride_wg)
    else:
        pdl_wait(PDL)
        p0, p1, p2, p3 = _x_pairs(x_ptr, t_begin * (GROUP // 2), NW)         # (unused: XPF is off here)
        for t in tl.range(t_begin, t_end, num_stages=STAGES):
            words = tl.load(wp + t * stride_wg)
            s = tl.load(sp + t * stride_sg)
            zp = _zpair(zq + t * stride_sg, ZFMT)
            total += _group_dot(x_ptr, t, words, s, zp, ASM, GROUP, EMULATE, p0, p1, p2, p3, False, PERM)
    pdl_launch_next(PDL)                      # late: the next kernel's programs would hold SM slots
    acc = sum_last(total, 1)[None, :]                                        # [1, BLOCK_N]
    finish_split(acc, out_ptr, out_ptr, part_ptr, counter_ptr, tl.arange(0, 1), offs_n, 1, N, N, pid_n, pid_k,
                 tl.num_programs(1), False, SPLIT)


def pipe_operands(qweight, scales, zeros, zfmt: int, sg: bool, tile: int = 0, group: int = 128, perm: bool = False):
    """The kernel's operands from `quantize_int4`'s: words [N, K / 8] (or, with `tile`, [N / tile, groups, tile,
    group / 8]: a program's group tile contiguous), scales and zero points in the asked formats."""
    if perm:                                  # the package's nibble order (`NIBBLES`)
        n = qweight.shape[0]
        qweight = pack_int4(unpack_int4(qweight).reshape(n, -1, 8)[:, :, list(NIBBLES)].reshape(n, -1))
    if tile:
        N, KW = qweight.view(torch.int32).shape
        qweight = qweight.view(torch.int32).view(N // tile, tile, KW // (group // 8), group // 8)  # [NB, P, G, NW]
        qweight = qweight.permute(0, 2, 1, 3).contiguous()                                      # [NB, G, P, NW]
    z = zeros.to(torch.int32) | 0xC300
    z = (z | (z << 16)).to(torch.int32) if zfmt == 1 else zeros                 # the ready pair (int32 wraps)
    if sg: scales, z = scales.t().contiguous(), z.t().contiguous()              # [groups, N]
    return qweight.view(torch.int32), scales, z


def pipe_int4(x, words, scales, zp, N: int, cfg: dict, pdl: bool, group: int = 128):
    "x [1, K] -> [1, N] bf16 with `pipe_int4_kernel` under `cfg` (BLOCK_N, num_warps, SPLIT_K, MODE, ...)."
    K = x.shape[1]
    bn, nw = cfg["BLOCK_N"], group // 8
    strides = (bn * K // 8, nw, bn * nw) if cfg.get("TILED") else (bn * K // 8, K // 8, nw)   # block, row, group
    per, split = split_tiles(K, group, cfg["SPLIT_K"])
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    part = torch.empty(split, 1, N, dtype=torch.float32, device=x.device) if split > 1 else out
    counters = split_counters(x.device, N // cfg["BLOCK_N"]) if split > 1 else out
    sg = cfg.get("SG", False)
    stride_sn, stride_sg = (1, N) if sg else (scales.shape[1], 1)
    pipe_int4_kernel[(N // cfg["BLOCK_N"], split)](
        x, words, scales, zp, out, part, counters, N, K, per, *strides, stride_sn, stride_sg,
        BLOCK_N=cfg["BLOCK_N"], GROUP=group, SPLIT=split > 1, ASM=PAIRS_ASM_SHIFT, MODE=cfg.get("MODE", 0),
        STAGES=cfg.get("STAGES", 1), DEPTH=cfg.get("DEPTH", 1), XPF=cfg.get("XPF", False), ZFMT=cfg.get("ZFMT", 0),
        PDL=pdl, EMULATE=EMULATE, PERM=cfg.get("PERM", False), num_warps=cfg["num_warps"], num_stages=1,
        **launch_options(pdl),
        **({"maxnreg": cfg["MAXNREG"]} if cfg.get("MAXNREG") else {}))
    return out


SPLITS = {(37888, 3584): (2, 3, 4), (3584, 18944): (15, 30, 37), (4608, 3584): (7, 14, 28),
          (3584, 3584): (7, 14, 28)}


def pipe_cands(N, K, shipped: dict):
    """Phase 1: the shipped placement (MODE 2) at the shipped tile (the control of this kernel against the
    package's), then both placements, row-major and TILED, over blocks, warps, splits (and stages), scales and
    zero points stored [groups, N]."""
    sks = SPLITS.get((N, K), (4, 8, 16))
    ship = {"BLOCK_N": shipped["BLOCK_N"], "num_warps": shipped["num_warps"], "SPLIT_K": shipped["SPLIT_K"],
            **({"MAXNREG": shipped["MAXNREG"]} if shipped.get("MAXNREG") else {})}
    out = [{**ship, "MODE": 2}, {**ship, "MODE": 2, "TILED": True}, {**ship, "MODE": 2, "TILED": True, "SG": True}]
    modes = [{"MODE": 2, "SG": True}, {"MODE": 1, "STAGES": 2, "ZFMT": 1, "SG": True},
             {"MODE": 1, "STAGES": 3, "ZFMT": 1, "SG": True}, {"MODE": 1, "STAGES": 4, "ZFMT": 1, "SG": True}]
    for tiled in (True, False):
        for m in modes:
            for bn in (128, 64, 256):
                for nw in (4, 8):
                    for sk in sks:
                        if N % bn == 0: out.append({"BLOCK_N": bn, "num_warps": nw, "SPLIT_K": sk, "TILED": tiled, **m})
    return out


def perm_cands(N, K, shipped: dict):
    """The tiled layout with the package's nibble order (PERM): the package's loop (MODE 2) against Triton's
    pipeline (MODE 1, ready zero-point pairs) over narrow blocks, warps, splits and stages."""
    sks = {(37888, 3584): (1, 2, 3), (3584, 18944): (8, 15, 19), (4608, 3584): (4, 7, 14),
           (3584, 3584): (4, 7, 14)}.get((N, K), (4, 8, 16))
    modes = [{"MODE": 2}, {"MODE": 1, "STAGES": 2, "ZFMT": 1}, {"MODE": 1, "STAGES": 3, "ZFMT": 1},
             {"MODE": 1, "STAGES": 4, "ZFMT": 1}]
    return [{"BLOCK_N": bn, "num_warps": nw, "SPLIT_K": sk, "TILED": True, "SG": True, "PERM": True, **m}
            for m in modes for bn in (32, 64) for nw in (1, 2, 4) for sk in sks]


def near_cands(best: dict):
    "Phase 2, around phase 1's best: scales and zero points stored [groups, N], and a stage more or less."
    out = [{**best, "SG": not best.get("SG", False)}, {**best, "TILED": not best.get("TILED", False)}]
    if best.get("MODE") == 1:
        out += [{**best, "STAGES": best["STAGES"] + 1}, {**best, "STAGES": best["STAGES"] + 2},
                {**best, "ZFMT": 0}]
    for reg in (64, 80, 96, 128):
        out.append({**best, "MAXNREG": reg})
    return out


PIPE_BUDGETS = (("gate_up_proj", 150.0), ("down_proj", 150.0), ("qkv_proj", 60.0), ("o_proj", 60.0))


def pipe_sweep(res, smoke: bool, save=lambda: None, cands_of=None, key="pipe", near=True):
    "Per 7B projection: the shipped kernel, then the candidates (PDL on), within each projection's budget."
    rows = res.setdefault(key, [])
    shapes = {name: (N, K) for name, N, K, _ in layer_shapes("7B", smoke, TINY)}
    pdl = DEVICE.type == "cuda"
    for name, budget_s in [(n, 0.0) for n in shapes] if smoke else PIPE_BUDGETS:
        N, K = shapes[name]
        t0 = time.perf_counter()
        w, x, q, qb, qs, ref = layer_case(N, K)
        shipped = SMOKE_SHIPPED if smoke else quant_tables()["tuned_gemv"].get(("int4", N, K))
        row = {"layer": name, "N": N, "K": K, "bytes": qb, "shipped": shipped,
               "shipped_us": graph_bench(lambda i: (lambda: quant_matmul(x, *qs[i], None, "int4", 128, pdl=pdl)), qb,
                                         device=DEVICE), "trials": []}
        tile = gemv_tile(N, K, 128)
        if tile:                                  # the package as it ships: its layout and table
            shipped_ops = [tile_int4(*c, 128, tile) for c in qs]
            row["package_us"] = graph_bench(
                lambda i: (lambda: quant_matmul(x, *shipped_ops[i], None, "int4", 128, pdl=pdl)), qb, device=DEVICE)
            del shipped_ops
        ops = {}

        def trial(cfg):
            key = (cfg.get("ZFMT", 0), cfg.get("SG", False), cfg["BLOCK_N"] if cfg.get("TILED") else 0, 128,
                   cfg.get("PERM", False))
            if key not in ops: ops[key] = [pipe_operands(*c, *key) for c in qs]
            try:
                err = max_rel_err(pipe_int4(x, *ops[key][0], N, cfg, pdl), ref)
                us = graph_bench(lambda i: (lambda: pipe_int4(x, *ops[key][i], N, cfg, pdl)), qb, device=DEVICE)
            except Exception as e:                                  # a config that does not compile
                row["trials"].append({**cfg, "error": repr(e)[:300]}); print(name, cfg, repr(e)[:300]); return
            r = trial_row(cfg, us, err, qb)
            row["trials"].append(r)
            print("pipe", name, round(min(row["shipped_us"]), 2), r, flush=True)
            checked(err, (name, cfg))

        for i, cfg in enumerate((cands_of or pipe_cands)(N, K, row["shipped"])):
            if (smoke and i >= 2) or (not smoke and time.perf_counter() - t0 > budget_s): break
            trial(cfg)
        ok = [r for r in row["trials"] if "us" in r]
        best = min(ok, key=lambda r: r["best_us"])
        around = {k: v for k, v in best.items() if k not in ("us", "best_us", "rel_err", "GBps")}
        for cfg in (near_cands(around)[:1] if smoke else near_cands(around)) if near else ():
            trial(cfg)
        best_trial(row)
        print("pipe", name, "shipped", min(row["shipped_us"]), "best", row["best"], flush=True)
        rows.append(row)
        save()
        del qs, ops, w; torch.cuda.empty_cache()


def package_cands(N, K):
    "Blocks (tiles of their own width) x warps x splits x register caps."
    sks = (1, 2, 3, 4) if N > 30000 else ((8, 15, 30) if K > 10000 else (7, 14, 28))
    return [{"BLOCK_N": bn, "num_warps": nw, "SPLIT_K": sk, **({"MAXNREG": mr} if mr else {})}
            for bn in (64, 128, 256, 32) for nw in (4, 8, 2) for sk in sks for mr in (None, 128)
            if N % bn == 0 and not (nw == 2 and bn > 128) and not (mr and nw == 2)]


def narrow_cands(N, K):
    "The narrow end, where the first package sweep's best lay: 16 and 32 channels a program, one and two warps."
    sks = (1, 2, 3) if N > 30000 else ((10, 15, 19, 30) if K > 10000 else (4, 7, 14))
    return [{"BLOCK_N": bn, "num_warps": nw, "SPLIT_K": sk} for bn in (32, 16) for nw in (2, 1) for sk in sks]


def package_sweep(res, smoke: bool, save=lambda: None, budget_s: float = 60.0, cands_of=package_cands, key="package"):
    """The package's one-row INT4 GEMV (`quant_gemv`) on weights in `tile_int4`'s layout, over blocks (each with
    tiles of its own width), warps, splits and register caps, per 7B projection and the 7B LM head; the row-major
    layout at the shipped configuration as the control, and the package's choice (`quant_matmul` on what
    `QuantLinear` would store) in the same run."""
    rows = res.setdefault(key, [])
    shapes = [(name, N, K) for name, N, K, _ in layer_shapes("7B", smoke, TINY)]
    if not smoke: shapes.append(("lm_head", 152064, 3584))
    pdl = DEVICE.type == "cuda"
    for name, N, K in shapes:
        t0 = time.perf_counter()
        w, x, q, qb, qs, ref = layer_case(N, K)
        ship = dict(quant_tables()["tuned_gemv"].get(("int4", N, K), {}))
        tile = gemv_tile(N, K, 128)
        tiled = {}

        def layout(t):
            if t not in tiled: tiled[t] = [tile_int4(*c, 128, t) for c in qs]
            return tiled[t]

        row = {"layer": name, "N": N, "K": K, "bytes": qb, "shipped": ship, "tile": tile, "trials": [],
               "rows_us": graph_bench(lambda i: (lambda: quant_gemv(x, *qs[i], None, "int4", 128, pdl=pdl)), qb,
                                      device=DEVICE)}
        if tile:
            row["package_us"] = graph_bench(
                lambda i: (lambda: quant_matmul(x, *layout(tile)[i], None, "int4", 128, pdl=pdl)), qb, device=DEVICE)
        cands = [c for c in cands_of(N, K) if N % c["BLOCK_N"] == 0]
        for cfg in cands[:2] if smoke else cands:
            if not smoke and time.perf_counter() - t0 > budget_s: break
            ops = layout(cfg["BLOCK_N"])
            try:
                err = max_rel_err(quant_gemv(x, *ops[0], None, "int4", 128, config=cfg, pdl=pdl), ref)
                us = graph_bench(lambda i: (lambda: quant_gemv(x, *ops[i], None, "int4", 128, config=cfg, pdl=pdl)),
                                 qb, device=DEVICE)
            except Exception as e:
                row["trials"].append({**cfg, "error": repr(e)[:300]}); print(name, cfg, repr(e)[:300]); continue
            row["trials"].append(trial_row(cfg, us, err, qb))
            checked(err, (name, cfg))
        ok = best_trial(row)
        print(key, name, "rows", round(min(row["rows_us"]), 2), "package",
              round(min(row.get("package_us", [0])), 2), "best", row["best"], len(ok), flush=True)
        rows.append(row)
        save()
        del qs, tiled, w; torch.cuda.empty_cache()


def main():
    args = parser(__doc__, parts="pipe").parse_args()
    device_or_skip(args)
    smoke = is_smoke(args)
    res = {"timer": "graph_bench (us per call, two passes)"}
    out = "quant_pipe_h200.json"
    save = lambda: write(out, res, args)                 # after every projection, as well as after every part
    parts = {"pipe": lambda: pipe_sweep(res, smoke, save), "package": lambda: package_sweep(res, smoke, save),
             "narrow": lambda: package_sweep(res, smoke, save, cands_of=narrow_cands, key="narrow"),
             "perm": lambda: pipe_sweep(res, smoke, save, cands_of=perm_cands, key="perm", near=False)}
    run_parts(parts, ",".join(parts) if smoke else args.parts, saver(out, res, args))
    exit_if_failed(res)


if __name__ == "__main__":
    main()

"""What the one-row quantized GEMVs cost in instructions, counted without a GPU.

Run on any machine from the repo root (no GPU: Triton's own ptxas and nvdisasm compile and disassemble for sm_90):
    PYTHONPATH=. python kernels/quant_sass_cpu.py --out figures/data
For each 7B projection and each variant of the kernel, `nanoserve.quant.compile_one_row` compiles exactly what
`quant_gemv` (or `quant_gemm`, for the layers the few-rows table sends to the tensor cores) would launch at one row,
or, for the variants that left the package, this script's fork of the kernel (`pairs_fork_kernel`: the packed pairs
with the zero point outside them, and the words on the tensor cores). It disassembles each, finds the main loop
(the largest backward branch), and writes to quant_sass_cpu.json: registers a thread, the programs a multiprocessor
can hold by registers, the loop's instructions by opcode and by source line, the weights a thread handles per trip,
the loop's instructions per weight, a whole-kernel estimate (instructions outside the loop once, the loop times its
trips), and every global load by source line and width. Static counts predict the instruction stream, not the time.

Check first: the INT8 gate/up GEMV is the kernel Nsight Compute profiled on the H200
(figures/data/quant_ncu_h200.csv): its estimate must come within 5% of what Nsight counted, with the same
registers; and the zero point inside the pairs must count fewer instructions a weight than the fork without it.
`--smoke` compiles just those three kernels (a compile costs the same at any shape) and writes to a temp folder.
This script runs no kernel, so it never uses the interpreter: it imports the package with TRITON_INTERPRET=0.
"""
import os, sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"      # compile for sm_90, never interpret: set before nanoserve is imported
import nanoserve.quant as Q               # noqa: E402  (before lab, which turns the interpreter on under --smoke)

sys.path.insert(0, str(Path(__file__).parent))
from lab import disassemble, instructions, is_smoke, main_loop, parser, write   # noqa: E402
os.environ["TRITON_INTERPRET"] = "0"      # (lab's --smoke switch is for scripts that run kernels)

import csv, re                            # noqa: E402
from collections import Counter           # noqa: E402

import torch                              # noqa: E402
import triton                             # noqa: E402
import triton.language as tl              # noqa: E402

from nanoserve.quant import _dequant_words, _qw_col, _qw_rows, compile_one_row, gemm_launch, gemv_launch  # noqa: E402
from nanoserve.runtime import finish_split, pdl_launch_next, pdl_wait, sum_last                          # noqa: E402

NCU_CSV = Path(__file__).resolve().parent.parent / "figures/data/quant_ncu_h200.csv"
LAYERS_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
# The one-row table the variants are counted over (before the sweeps that found the shipped one: the INT8 gate/up
# entry is the kernel Nsight Compute profiled), with the keys that came later switched off; the "(table now)"
# variants are counted over the package's table as it is.
FIRST_TABLE = {
    ("int8", 4608, 3584): {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "PAIRS": True, "SPLIT_K": 7},
    ("int8", 3584, 3584): {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "PAIRS": True, "SPLIT_K": 8},
    ("int8", 37888, 3584): {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 3, "PAIRS": True,
                            "SPLIT_K": 1},
    ("int8", 3584, 18944): {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 8, "num_stages": 3, "PAIRS": True,
                            "SPLIT_K": 10},
    ("int4", 4608, 3584): {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1, "PAIRS": False,
                           "SPLIT_K": 14, "WORDS": True, "HALF2": True},
    ("int4", 3584, 3584): {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 1, "PAIRS": False,
                           "SPLIT_K": 14, "WORDS": True, "HALF2": True},
    ("int4", 37888, 3584): {"BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1, "PAIRS": False,
                            "SPLIT_K": 8, "WORDS": True, "HALF2": True},
    ("int4", 3584, 18944): {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1, "PAIRS": False,
                            "SPLIT_K": 16, "WORDS": True, "HALF2": True},
}
LATER_OFF = {"SHIFT": False, "F16": False, "MAXNREG": None}
NOW = "table now"
# name -> (method, config over FIRST_TABLE, the fork that runs it: None for the package's kernel)
VARIANTS = {
    "int8": ("int8", {}, None),
    "int4 words fp32": ("int4", {"HALF2": False}, None),
    "int4 pairs (shipped)": ("int4", {}, "pairs"),                 # the first packed pairs: zero point outside
    "int4 pairs, lanes by shift": ("int4", {"SHIFT": True}, "pairs"),
    "int4 zero point in pairs": ("int4", {}, None),                # the package's pairs, lanes by cvt
    "int4 zero point in pairs, lanes by shift": ("int4", {"SHIFT": True}, None),
    "int8 tensor-core GEMM (FEW_ROWS_GEMM)": ("int8", "gemm", None),   # the engine's INT8 gate/up and down
    "int8 fp16 pairs": ("int8", {"F16": True}, None),              # on the INT8 GEMV table's blocks
    "int8 fp16 pairs, 64x128x4": ("int8", {"F16": True, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                                           "SPLIT_K": None}, None),   # the blocks the static counts favour
    # like for like, 64 channels and 4 warps a program: the packed pairs against the tensor cores
    "int4 zero point in pairs, 64x4": ("int4", {"BLOCK_N": 64, "num_warps": 4}, None),
    "int4 tensor cores, 64x4": ("int4", {"BLOCK_N": 64, "num_warps": 4}, "dot"),
    "int4 (table now)": ("int4", NOW, None),                       # zero point in pairs, lanes by shift, swept
    "int8 (table now)": ("int8", NOW, None),                       # fp16 pairs, the 2-D tile, swept
    # the input made as it loads (`KernelConfig.quant_made_input`): the norm before QKV and gate/up, SiLU x up
    # before down (the output projection takes its input as it is: no row)
    "int4 (table now), input made": ("int4", NOW, None),
    "int8 (table now), input made": ("int8", NOW, None),
    # the same, ptxas capped at 64-80 registers (the made INT4 gate/up takes 96, the plain one 56)
    **{f"int4 (table now), input made, MAXNREG {r}": ("int4", (NOW, {"MAXNREG": r}), None) for r in (64, 72, 80)},
}
MADE = {"qkv": 1, "gate_up": 1, "down": 2}                             # IN: the norm (with a residual), SiLU x up
SMOKE_ROWS = (("gate_up", "int8"), ("o", "int4 zero point in pairs"), ("o", "int4 pairs (shipped)"))
REGS_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 64, 32      # sm_90


# ---- the fork: the variants that left the package ----------------------------------------------------------------
@triton.jit
def _bf16_bits(ptr):
    "bf16 values at `ptr` as the low 16 bits of int32s."
    return tl.load(ptr).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _bits_value(bits):
    "The fp32 value of bf16 bits held in the low half of int32s."
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _pairs_outside(x_ptr, words, t, s, z, j, ASM: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                   TILE: tl.constexpr):
    "One group: the sum of q x per word in packed pairs (z = 0 in the pairs), the zero point applied after -> [BLOCK_N, NW]."
    xk = x_ptr + t * GROUP + 8 * j                                # [NW]: word j's inputs 8 j + m
    A: tl.constexpr = 1 if TILE == 0 else 2                      # pair k: inputs 8 j + k, 8 j + k + 4
    B: tl.constexpr = 4 if TILE == 0 else 1                      # (tile_int4's: 8 j + 2 k, 8 j + 2 k + 1)
    lo0, hi0 = _bf16_bits(xk), _bf16_bits(xk + B)
    lo1, hi1 = _bf16_bits(xk + A), _bf16_bits(xk + A + B)
    lo2, hi2 = _bf16_bits(xk + 2 * A), _bf16_bits(xk + 2 * A + B)
    lo3, hi3 = _bf16_bits(xk + 3 * A), _bf16_bits(xk + 3 * A + B)
    xsum = (_bits_value(lo0) + _bits_value(hi0) + _bits_value(lo1) + _bits_value(hi1)
            + _bits_value(lo2) + _bits_value(hi2) + _bits_value(lo3) + _bits_value(hi3))   # [NW]: the word's inputs
    neg = tl.full([BLOCK_N, 1], -1023360256, tl.int32)            # the pair -128, -128 (`neg_pair()`)
    dot = tl.inline_asm_elementwise(
        ASM, "=f,r,r,r,r,r,r", [words, (lo0 | (hi0 << 16))[None, :], (lo1 | (hi1 << 16))[None, :],
                                (lo2 | (hi2 << 16))[None, :], (lo3 | (hi3 << 16))[None, :], neg],
        dtype=tl.float32, is_pure=True, pack=1)                   # [BLOCK_N, NW]: sum over the word of q x
    return dot * s[:, None] - (s * z)[:, None] * xsum[None, :]


@triton.jit
def _words_on_tensor_cores(x_ptr, words, t, s, zb, GROUP: tl.constexpr, TILE: tl.constexpr):
    "One group on the tensor cores: the row padded to 16 with zeros times the dequantized words -> [16, BLOCK_N]."
    rows = tl.arange(0, 16)
    w = _dequant_words(words, (zb | (zb << 16))[:, None], False, TILE != 0)   # [BLOCK_N, GROUP]: q - z
    xt = tl.load(x_ptr + (t * GROUP + tl.arange(0, GROUP))[None, :] + 0 * rows[:, None],
                 mask=(rows == 0)[:, None], other=0.0)                         # [16, GROUP]: the row, then zeros
    return tl.dot(xt, tl.trans(w)) * s[None, :]


@triton.jit
def pairs_fork_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, K,
                      tiles_per_split, stride_xm, stride_qn, stride_sn, stride_om, stride_qb, stride_qg, stride_sg,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr,
                      TILE: tl.constexpr, DOT: tl.constexpr):
    "`quant_gemv_kernel`'s one-row INT4 words path as it was before the zero point moved into the pairs (or `DOT`)."
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, (K + BLOCK_K - 1) // BLOCK_K)
    NW: tl.constexpr = GROUP // 8
    j = tl.arange(0, NW)
    wp = qweight_ptr + _qw_rows(n0, BLOCK_N, TILE, stride_qb, stride_qn)[:, None] + j[None, :]   # [BLOCK_N, NW]
    words = tl.load(wp + _qw_col(t_begin * NW, NW, TILE, stride_qg))      # the first tile: before the wait
    pdl_wait(PDL)
    if DOT:
        total = tl.full([16, BLOCK_N], 0.0, tl.float32)
    else:
        total = tl.full([BLOCK_N, NW], 0.0, tl.float32)
    for t in range(t_begin, t_end):
        s = tl.load(scales_ptr + offs_n * stride_sn + t * stride_sg)
        if DOT:
            zb = tl.load(zeros_ptr + offs_n * stride_sn + t * stride_sg).to(tl.int32) | 0xC300   # -(128 + z)
            total += _words_on_tensor_cores(x_ptr, words, t, s, zb, GROUP, TILE)
        else:
            z = tl.load(zeros_ptr + offs_n * stride_sn + t * stride_sg).to(tl.float32)
            total += _pairs_outside(x_ptr, words, t, s, z, j, ASM, GROUP, BLOCK_N, TILE)
        words = tl.load(wp + _qw_col(tl.minimum(t + 1, t_end - 1) * NW, NW, TILE, stride_qg))   # the next tile
    pdl_launch_next(PDL)
    if DOT:
        acc = sum_last(tl.trans(total), 1)[None, :]                      # [1, BLOCK_N]: row 0 (the rest are 0)
    else:
        acc = sum_last(total, 1)[None, :]                                # [1, BLOCK_N]
    finish_split(acc, bias_ptr, out_ptr, part_ptr, counter_ptr, tl.arange(0, BLOCK_M), offs_n, M, N, stride_om,
                 pid_n, pid_k, tl.num_programs(1), HAS_BIAS, SPLIT)


# ---- disassembly -------------------------------------------------------------------------------------------------
def family(op: str) -> str: return op.split(".")[0]


def source_text(src: str) -> str:
    "The text of a 'file:line' of the package or of this script (the SASS's line info), stripped."
    name, line = src.rsplit(":", 1)
    here = Path(__file__).resolve()
    path = here if name == here.name else here.parent.parent / "nanoserve" / name
    return path.read_text().splitlines()[int(line) - 1].strip() if path.exists() else ""


def global_loads(sass: str) -> dict[str, dict[str, int]]:
    "Every global load of a kernel, by source line: {code: {opcode: count}} (an opcode's suffix is its width)."
    out: dict[str, dict[str, int]] = {}
    for _, op, src, _ in instructions(sass)[0]:
        if op.startswith("LDG"):
            ops = out.setdefault(source_text(src), {})
            ops[op] = ops.get(op, 0) + 1
    return out


# ---- counting ----------------------------------------------------------------------------------------------------
def is_now(cfg) -> bool:
    "Whether a variant's config is the table now (NOW, or (NOW, options over it))."
    return cfg == NOW or (isinstance(cfg, tuple) and cfg[0] == NOW)


def now_config(cfg) -> dict:
    "The options a table-now variant sets over the table ({}: none)."
    return cfg[1] if isinstance(cfg, tuple) else {}


def variant_launch(N: int, K: int, name: str):
    "(method, config, is GEMM, fork, the launch) of one variant on one layer, as `compile_one_row` will compile it."
    method, cfg, fork = VARIANTS[name]
    group = 128 if method == "int4" else None
    gemm = cfg == "gemm"
    if gemm:
        cfg = Q.quant_tables()["few_rows_gemm"][(method, N, K)]
        return method, cfg, True, fork, gemm_launch(1, N, K, method, group, 132, cfg, interpret=False)
    cfg = now_config(cfg) if is_now(cfg) else {**LATER_OFF, **FIRST_TABLE[(method, N, K)], **cfg}
    return method, cfg, False, fork, gemv_launch(1, N, K, method, group, torch.bfloat16, 132, cfg, pdl=True,
                                                 interpret=False)


def compiled(N: int, K: int, name: str, method: str, cfg: dict, gemm: bool, fork: str | None):
    "The compiled kernel of a variant: the package's (the older variants on rows), or this script's fork."
    group = 128 if method == "int4" else None
    tile = None if is_now(VARIANTS[name][1]) else 0    # the older variants read rows (the tiled layout came later)
    extra = {} if fork is None else {"kernel": pairs_fork_kernel, "extra": {"DOT": fork == "dot"}}
    if "input made" in name:
        made = MADE[next(layer for layer, shape in LAYERS_7B.items() if shape == (N, K))]
        row_w = triton.next_power_of_2(K // 2) if made == 1 else 1
        extra = {"extra": {"IN": made, "HAS_RESIDUAL": made == 1, "ROW_W": row_w}}
    return compile_one_row(N, K, method, group, torch.bfloat16, cfg, pdl=True, gemm=gemm, tile=tile, **extra)


def count(N: int, K: int, name: str) -> dict:
    "The static counts of one variant on one [N, K] layer at one row."
    method, cfg, gemm, fork, run = variant_launch(N, K, name)
    c = {"WORDS": False, "HALF2": False, "EVEN": False, "F16": False} | run["constexprs"]
    c |= {"ZPAIR": c["HALF2"] and fork is None, "DOT": fork == "dot"}
    sass, usage = disassemble(compiled(N, K, name, method, cfg, gemm, fork).asm["cubin"])
    loop, ins = main_loop(sass)
    threads = 32 * run["num_warps"]
    per_trip = c["BLOCK_N"] * c["BLOCK_K"] // threads                     # weights a thread handles per trip
    trips = run["tiles_per_split"] - (1 if method == "int8" and c["EVEN"] and not (gemm or c["F16"]) else 0)  # peeled
    programs = int(torch.tensor(run["grid"]).prod())
    by_regs = REGS_PER_SM // (usage["REG"] * threads)
    estimate = (len(ins) - len(loop) + len(loop) * trips) * run["num_warps"] * programs   # warp instructions
    shown = ("BLOCK_N", "BLOCK_K", "ZPAIR", "HALF2", "WORDS", "DOT", "F16")
    kernel = "pairs_fork_kernel" if fork else ("quant_gemm_kernel" if gemm else "quant_gemv_kernel")
    return {"layer_N_K": [N, K], "variant": name, "config": {k: c[k] for k in shown}
            | {"num_warps": run["num_warps"], "grid": list(run["grid"]), "tiles_per_split": run["tiles_per_split"],
               "shift_lanes": bool(cfg.get("SHIFT")), "kernel": kernel},
            "registers": usage["REG"], "shared_bytes": usage.get("SHARED", 0), "stack_bytes": usage.get("STACK", 0),
            "programs_per_sm_by_registers": min(by_regs, MAX_PROGRAMS_PER_SM, MAX_WARPS_PER_SM // run["num_warps"]),
            "loop_instructions": len(loop), "weights_per_thread_per_trip": per_trip,
            "loop_instructions_per_weight": round(len(loop) / per_trip, 3),
            "loop_opcodes": dict(Counter(family(i[1]) for i in loop).most_common()),
            "loop_by_source_line": [{"line": src, "instructions": n, "code": source_text(src)}
                                    for src, n in Counter(i[2] for i in loop).most_common()],
            "kernel_instructions": len(ins), "global_loads": global_loads(sass),
            "estimated_warp_instructions": estimate,
            "estimated_instructions_per_weight": round(estimate * 32 / (N * K), 3)}


def ncu_counts(path: Path) -> dict:
    "Executed instructions and registers per (grid, block) from an `ncu --csv` dump."
    out = {}
    for row in csv.DictReader(line for line in path.read_text().splitlines() if line.startswith('"')):
        if row["Metric Name"] in ("Executed Instructions", "Registers Per Thread"):
            out.setdefault(row["Grid Size"], {})[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    return out


def check(rows: list[dict]) -> dict:
    """The INT8 gate/up estimate against Nsight Compute's count of the same kernel (grid 2368 x 1, 256 threads),
    and the zero point inside the pairs against the fork without it: asserted."""
    ncu = ncu_counts(NCU_CSV)["(2368, 1, 1)"]
    find = lambda name, shape: next(r for r in rows if r["variant"] == name and r["layer_N_K"] == list(shape))
    int8_gu = find("int8", LAYERS_7B["gate_up"])
    inside, outside = find("int4 zero point in pairs", LAYERS_7B["o"]), find("int4 pairs (shipped)", LAYERS_7B["o"])
    out = {"ncu_executed_warp_instructions": ncu["Executed Instructions"], "ncu_registers": ncu["Registers Per Thread"],
           "static_estimate_warp_instructions": int8_gu["estimated_warp_instructions"],
           "static_registers": int8_gu["registers"],
           "estimate_over_ncu": round(int8_gu["estimated_warp_instructions"] / ncu["Executed Instructions"], 3)}
    print("INT8 gate/up against Nsight Compute:", out)
    assert abs(out["estimate_over_ncu"] - 1) < 0.05 and out["static_registers"] == out["ncu_registers"], out
    assert inside["estimated_instructions_per_weight"] < outside["estimated_instructions_per_weight"]
    return out


def show(r: dict) -> None:
    print(f"{r['layer_N_K']!s:>14} {r['variant']:<42} regs {r['registers']:>3} ({r['programs_per_sm_by_registers']} "
          f"programs/SM)  loop {r['loop_instructions']:>4} / {r['weights_per_thread_per_trip']:>3} weights = "
          f"{r['loop_instructions_per_weight']:.2f}  kernel ~{r['estimated_instructions_per_weight']:.2f} a weight",
          flush=True)


def main():
    args = parser(__doc__, out="figures/data").parse_args()
    if is_smoke(args):
        cases = [(*LAYERS_7B[layer], name) for layer, name in SMOKE_ROWS]
    else:
        cases = [(N, K, name) for layer, (N, K) in LAYERS_7B.items() for name in VARIANTS
                 if (VARIANTS[name][1] != "gemm" or (VARIANTS[name][0], N, K) in Q.quant_tables()["few_rows_gemm"])
                 and (layer in MADE or "input made" not in name)]
    rows = []
    for N, K, name in cases:
        rows.append(count(N, K, name)); show(rows[-1])
    agreement = check(rows)
    write("quant_sass_cpu.json", {"compiled": "for sm_90 on the CPU (Triton's ptxas, nvdisasm)",
                                  "triton": triton.__version__, "rows": rows, "ncu_check_int8_gate_up": agreement}, args)


if __name__ == "__main__":
    main()

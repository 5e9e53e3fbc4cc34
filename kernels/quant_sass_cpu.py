"""What the one-row quantized GEMVs cost in instructions, counted without a GPU (issue 9).

Run on any machine from the repo root (no GPU: Triton's own ptxas and nvdisasm compile and disassemble for sm_90):
    PYTHONPATH=. python kernels/quant_sass_cpu.py --out figures/data
For each 7B projection and each variant of the kernel, `nanoserve.quant.compile_one_row` compiles exactly what
`quant_gemv` (or `quant_gemm`, for the layers `FEW_ROWS_GEMM` sends to the tensor cores) would launch at one
row; the script disassembles it, finds the main loop (the largest backward branch), and writes to
quant_sass_cpu.json: registers a thread, the programs a multiprocessor can hold by registers, the loop's
instructions by opcode and by source line, the weights a thread handles per trip, the loop's instructions per
weight, a whole-kernel estimate (instructions outside the loop once, the loop times its trips), and every global
load by source line and width (a count cannot see how many cache lines a load touches; its width is a hint). The INT8
gate/up row is checked against what Nsight Compute counted on the H200 for the same kernel
(figures/data/quant_ncu_h200.csv). Static counts predict the instruction stream, not the time.
"""
import os

os.environ["TRITON_INTERPRET"] = "0"      # before nanoserve is imported: compile, do not interpret

import argparse, csv, json, re, subprocess, tempfile
from collections import Counter
from pathlib import Path

import torch
import triton

from nanoserve.bench import run_meta
from nanoserve.quant import FEW_ROWS_GEMM, compile_one_row, gemm_launch, gemv_launch

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
LAYERS_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
# The one-row table before this session's sweeps (git 87b7e1d): the variants are counted over it (the INT8 gate/up
# entry is the kernel Nsight Compute profiled), with the keys that came later switched off; the "(table now)"
# variants are counted over the package's table as it is.
TABLE_87B7E1D = {
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
LATER_OFF = {"ZPAIR": False, "SHIFT": False, "F16": False, "MAXNREG": None}
NOW = "table now"
VARIANTS = {                                        # name -> (method, config over the 87b7e1d table)
    "int8": ("int8", {}),
    "int4 words fp32": ("int4", {"HALF2": False}),
    "int4 pairs (shipped)": ("int4", {}),
    "int4 pairs, lanes by shift": ("int4", {"SHIFT": True}),
    "int4 zero point in pairs": ("int4", {"ZPAIR": True}),
    "int4 zero point in pairs, lanes by shift": ("int4", {"ZPAIR": True, "SHIFT": True}),
    "int8 tensor-core GEMM (FEW_ROWS_GEMM)": ("int8", "gemm"),   # the engine's INT8 gate/up and down at one row
    "int8 fp16 pairs": ("int8", {"F16": True}),                  # on the INT8 GEMV table's blocks
    "int8 fp16 pairs, 64x128x4": ("int8", {"F16": True, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                                           "SPLIT_K": None}),     # the blocks the static counts favour
    # like for like, 64 channels and 4 warps a program: the packed pairs against the tensor cores (`DOT`)
    "int4 zero point in pairs, 64x4": ("int4", {"ZPAIR": True, "BLOCK_N": 64, "num_warps": 4}),
    "int4 tensor cores, 64x4": ("int4", {"DOT": True, "BLOCK_N": 64, "num_warps": 4}),
    "int4 (table now)": ("int4", NOW),                           # zero point in pairs, lanes by shift, swept
    "int8 (table now)": ("int8", NOW),                           # fp16 pairs, the 2-D tile, swept
}
REGS_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 64, 32      # sm_90


def disassemble(cubin: bytes) -> tuple[str, dict]:
    "nvdisasm's SASS (with source lines) and cuobjdump's resource usage (REG, SHARED, ...) of a cubin."
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin); f.flush()
        sass = subprocess.run([BIN / "nvdisasm", "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([BIN / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|SHARED|STACK|LOCAL):(\d+)", res)}
    return sass, usage


def instructions(sass: str) -> tuple[list[tuple[int, str, str, str]], dict[str, int]]:
    "SASS -> [(address, opcode, source 'file:line', text)], and each label's address."
    ins, labels, pending, src = [], {}, [], "?"
    for line in sass.splitlines():
        if m := re.match(r"\s*//## File \"(.*?)\", line (\d+)", line):
            src = f"{Path(m.group(1)).name}:{m.group(2)}"
        elif m := re.match(r"^(\.L_x_\d+):", line.strip()):
            pending.append(m.group(1))
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            addr, text = int(m.group(1), 16), m.group(2).strip()
            for lab in pending: labels[lab] = addr
            pending = []
            ins.append((addr, re.sub(r"^@!?U?P\w+\s+", "", text).split()[0], src, text))
    return ins, labels


def main_loop(sass: str) -> tuple[list, list]:
    "(the largest loop's instructions, all instructions): a loop is the range of a branch to an earlier label."
    ins, labels = instructions(sass)
    best = []
    for addr, op, _, text in ins:
        t = re.search(r"`\((\.L_x_\d+)\)", text)
        if op.startswith("BRA") and t and labels[t.group(1)] < addr:
            body = [i for i in ins if labels[t.group(1)] <= i[0] <= addr]
            if len(body) > len(best): best = body
    return best, ins


def family(op: str) -> str: return op.split(".")[0]


def source_text(src: str) -> str:
    "The text of a 'file:line' of the package (the SASS's line info), stripped."
    name, line = src.rsplit(":", 1)
    path = Path(__file__).parent.parent / "nanoserve" / name
    return path.read_text().splitlines()[int(line) - 1].strip() if path.exists() else ""


def global_loads(sass: str) -> dict[str, dict[str, int]]:
    "Every global load of a kernel, by source line: {code: {opcode: count}} (an opcode's suffix is its width)."
    out: dict[str, dict[str, int]] = {}
    for _, op, src, _ in instructions(sass)[0]:
        if op.startswith("LDG"):
            ops = out.setdefault(source_text(src), {})
            ops[op] = ops.get(op, 0) + 1
    return out


def count(N: int, K: int, name: str) -> dict:
    method, cfg = VARIANTS[name]
    group = 128 if method == "int4" else None
    gemm = cfg == "gemm"
    if cfg == NOW: cfg = {}
    elif not gemm: cfg = {**LATER_OFF, **TABLE_87B7E1D[(method, N, K)], **cfg}
    if gemm:
        cfg = FEW_ROWS_GEMM[(method, N, K)]
        run = gemm_launch(1, N, K, method, group, 132, cfg, interpret=False)
    else:
        run = gemv_launch(1, N, K, method, group, torch.bfloat16, 132, cfg, pdl=True, interpret=False)
    c = {"WORDS": False, "HALF2": False, "ZPAIR": False, "DOT": False, "EVEN": False, "F16": False} | run["constexprs"]
    tile = None if VARIANTS[name][1] == NOW else 0       # the older variants read rows (the tiled layout came later)
    cc = compile_one_row(N, K, method, group, torch.bfloat16, cfg, pdl=True, gemm=gemm, tile=tile)
    sass, usage = disassemble(cc.asm["cubin"])
    loop, ins = main_loop(sass)
    threads = 32 * run["num_warps"]
    per_trip = c["BLOCK_N"] * c["BLOCK_K"] // threads                     # weights a thread handles per trip
    trips = run["tiles_per_split"] - (1 if method == "int8" and c["EVEN"] and not (gemm or c["F16"]) else 0)  # peeled
    programs = int(torch.tensor(run["grid"]).prod())
    by_regs = REGS_PER_SM // (usage["REG"] * threads)
    estimate = (len(ins) - len(loop) + len(loop) * trips) * run["num_warps"] * programs   # warp instructions
    shown = ("BLOCK_N", "BLOCK_K", "ZPAIR", "HALF2", "WORDS", "DOT", "F16")
    return {"layer_N_K": [N, K], "variant": name, "config": {k: c[k] for k in shown}
            | {"num_warps": run["num_warps"], "grid": list(run["grid"]), "tiles_per_split": run["tiles_per_split"],
               "shift_lanes": bool(cfg.get("SHIFT")), "kernel": "quant_gemm_kernel" if gemm else "quant_gemv_kernel"},
            "registers": usage["REG"], "shared_bytes": usage.get("SHARED", 0),
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="figures/data")
    args = ap.parse_args()
    rows = [count(N, K, name) for N, K in LAYERS_7B.values() for name in VARIANTS
            if VARIANTS[name][1] != "gemm" or (VARIANTS[name][0], N, K) in FEW_ROWS_GEMM]
    for r in rows:
        print(f"{r['layer_N_K']!s:>14} {r['variant']:<42} regs {r['registers']:>3} "
              f"({r['programs_per_sm_by_registers']} "
              f"programs/SM)  loop {r['loop_instructions']:>4} / {r['weights_per_thread_per_trip']:>3} weights = "
              f"{r['loop_instructions_per_weight']:.2f}  kernel ~{r['estimated_instructions_per_weight']:.2f} a weight")
    # the INT8 gate/up GEMV is the kernel Nsight Compute profiled (grid 2368 x 1, 256 threads, pdl off there)
    ncu = ncu_counts(Path("figures/data/quant_ncu_h200.csv")).get("(2368, 1, 1)")
    int8_gu = next(r for r in rows if r["variant"] == "int8" and r["layer_N_K"] == [37888, 3584])
    check = {"ncu_executed_warp_instructions": ncu["Executed Instructions"],
             "ncu_registers": ncu["Registers Per Thread"],
             "static_estimate_warp_instructions": int8_gu["estimated_warp_instructions"],
             "static_registers": int8_gu["registers"],
             "estimate_over_ncu": round(int8_gu["estimated_warp_instructions"] / ncu["Executed Instructions"], 3)}
    print("INT8 gate/up against Nsight Compute:", check)
    res = {"meta": run_meta() | {"gpu": "none: compiled for sm_90 on the CPU (Triton's ptxas, nvdisasm)",
                                 "triton": triton.__version__},
           "command": "PYTHONPATH=. python kernels/quant_sass_cpu.py --out figures/data",
           "rows": rows, "ncu_check_int8_gate_up": check}
    Path(args.out, "quant_sass_cpu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

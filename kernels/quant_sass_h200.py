"""The instruction mix of the quantized one-row GEMV on the H200 (issue 9: why INT4 is compute-bound).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/quant_sass_h200.py --out $OUT
Compiles `quant_gemv_kernel` for the 7B gate/up projection at one row (the tuned INT8 and INT4 configurations),
writes each kernel's SASS (when the image has the disassembler; else empty) and PTX to quant_gemv_<method>_<i>.*,
and the count of each opcode in both, with the registers and shared memory per program, to quant_sass_h200.json
(git sha, GPU, versions, date).
"""
import argparse, json, os, re
from collections import Counter
from pathlib import Path

import torch

from nanoserve.bench import run_meta
from nanoserve.quant import quant_gemv, quant_gemv_kernel, quantize_int4, quantize_int8


def opcode_counts(sass: str) -> Counter:
    "Opcodes (the mnemonic before the first dot or space) of every instruction line."
    ops = Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m: ops[m.group(1)] += 1
    return ops


def compiled(fn):
    "Every compiled kernel in a JIT function's per-device caches."
    for v in fn.device_caches.values():
        cache = v[0] if isinstance(v, tuple) else v
        yield from cache.values()


def ptx_counts(ptx: str) -> Counter:
    "PTX instructions by their full opcode (e.g. `fma.rn.f32`), predicates and labels skipped."
    ops = Counter()
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)\s", line)
        if m and not line.strip().startswith(("//", ".")): ops[m.group(1)] += 1
    return ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res = {"meta": run_meta(), "command": "PYTHONPATH=. python kernels/quant_sass_h200.py --out $OUT", "kernels": {}}
    N, K = 37888, 3584
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    for method in ("int8", "int4"):
        q = quantize_int8(w) + (None,) if method == "int8" else quantize_int4(w, 128)
        before = {id(k) for k in compiled(quant_gemv_kernel)}
        quant_gemv(x, *q, None, method, 128)                    # compile with the tuned configuration
        torch.cuda.synchronize()
        for i, kern in enumerate(k for k in compiled(quant_gemv_kernel) if id(k) not in before):
            sass, ptx = kern.asm.get("sass") or "", kern.asm.get("ptx") or ""
            name = f"quant_gemv_{method}_{i}"
            (Path(args.out) / f"{name}.sass").write_text(sass)
            (Path(args.out) / f"{name}.ptx").write_text(ptx)
            ops, pops = opcode_counts(sass), ptx_counts(ptx)
            res["kernels"][name] = {"sass_opcodes": dict(ops.most_common()), "ptx_opcodes": dict(pops.most_common()),
                                    "registers": kern.n_regs, "shared_bytes": kern.metadata.shared}
            print(name, kern.n_regs, "regs", kern.metadata.shared, "smem", dict(pops.most_common(30)), flush=True)
    (Path(args.out) / "quant_sass_h200.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

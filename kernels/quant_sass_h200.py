"""The instruction mix of the quantized one-row GEMV on the H200 (issue 9: why INT4 is compute-bound).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/quant_sass_h200.py --out $OUT
Compiles `quant_gemv_kernel` for the 7B gate/up projection at one row (the tuned INT8 and INT4 configurations),
writes each kernel's SASS to quant_gemv_<method>.sass and the count of each opcode in its main loop and in total,
with the registers and shared memory per program, to quant_sass_h200.json (git sha, GPU, versions, date).
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
            sass = kern.asm.get("sass") or ""
            name = f"quant_gemv_{method}_{i}"
            (Path(args.out) / f"{name}.sass").write_text(sass)
            ops = opcode_counts(sass)
            res["kernels"][name] = {"opcodes": dict(ops.most_common()), "registers": kern.n_regs,
                                    "shared_bytes": kern.metadata.shared}
            print(name, kern.n_regs, "regs", dict(ops.most_common(25)), flush=True)
    (Path(args.out) / "quant_sass_h200.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

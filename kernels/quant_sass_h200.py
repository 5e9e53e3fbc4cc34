"""The instruction mix of the quantized one-row GEMV as the H200's JIT compiled it (why INT4 is compute-bound).

Run on the device machine from the repo root:
    PYTHONPATH=. python kernels/quant_sass_h200.py --out $OUT
Runs `quant_gemv` for the 7B gate/up projection at one row with the tuned INT8 and INT4 configurations, checked
against the reference first; writes each kernel it compiled, its SASS (when the image has the disassembler; else
empty) and PTX, to quant_gemv_<method>_<i>.*, and the count of each opcode in both, with the registers and shared
memory a program, to quant_sass_h200.json (run metadata inside). `--smoke`: a tiny layer on the CPU under the
interpreter, where nothing is compiled (no kernels listed) and nothing but the JSON is written, to a temp folder.
"""
import re, sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import device_or_skip, is_smoke, out_path, parser, rel_err, sync, write

import torch

from nanoserve.quant import quant_gemv, quant_gemv_kernel, quant_matmul_ref, quantize_int4, quantize_int8

GATE_UP, TINY = (37888, 3584), (256, 512)


def opcode_counts(sass: str) -> Counter:
    "Opcodes (the mnemonic before the first dot or space) of every instruction line."
    ops = Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m: ops[m.group(1)] += 1
    return ops


def ptx_counts(ptx: str) -> Counter:
    "PTX instructions by their full opcode (e.g. `fma.rn.f32`), predicates and labels skipped."
    ops = Counter()
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)\s", line)
        if m and not line.strip().startswith(("//", ".")): ops[m.group(1)] += 1
    return ops


def compiled(fn):
    "Every compiled kernel in a JIT function's per-device caches (none under the interpreter)."
    for v in getattr(fn, "device_caches", {}).values():
        cache = v[0] if isinstance(v, tuple) else v
        yield from cache.values()


def main():
    args = parser(__doc__).parse_args()
    device = device_or_skip(args)
    N, K = TINY if is_smoke(args) else GATE_UP
    folder = out_path("quant_sass_h200.json", args).parent
    folder.mkdir(parents=True, exist_ok=True)
    w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
    res = {"layer_N_K": [N, K], "kernels": {}}
    for method in ("int8", "int4"):
        q = quantize_int8(w) + (None,) if method == "int8" else quantize_int4(w, 128)
        before = {id(k) for k in compiled(quant_gemv_kernel)}
        err = rel_err(quant_gemv(x, *q, None, method, 128), quant_matmul_ref(x.float(), *q, None, method, 128))
        assert err < 0.02, (method, err)                 # check first (this call compiles the tuned configuration)
        sync(device)
        res[f"{method}_rel_err"] = err
        for i, kern in enumerate(k for k in compiled(quant_gemv_kernel) if id(k) not in before):
            sass, ptx = kern.asm.get("sass") or "", kern.asm.get("ptx") or ""
            name = f"quant_gemv_{method}_{i}"
            (folder / f"{name}.sass").write_text(sass)
            (folder / f"{name}.ptx").write_text(ptx)
            ops, pops = opcode_counts(sass), ptx_counts(ptx)
            res["kernels"][name] = {"sass_opcodes": dict(ops.most_common()), "ptx_opcodes": dict(pops.most_common()),
                                    "registers": kern.n_regs, "shared_bytes": kern.metadata.shared}
            print(name, kern.n_regs, "regs", kern.metadata.shared, "smem", dict(pops.most_common(30)), flush=True)
    write("quant_sass_h200.json", res, args)


if __name__ == "__main__":
    main()

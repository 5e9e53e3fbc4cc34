"""What each K/V cache dtype costs the decode kernel in instructions, counted without a GPU.

Run on any machine from the repo root (no GPU: Triton's own ptxas compiles for sm_90):
    PYTHONPATH=. python kernels/kv_ptx_cpu.py --out figures/data
The decode kernel as the engine launches it for Qwen3-0.6B's heads (16 query heads, 8 KV heads of 128, RoPE and the
q/k norms inside, four splits merged in the kernel), compiled over a bf16, an fp8 and an int8 cache. For each, the
PTX's instruction count (static: every instruction once, the tile loop's body included once) and its conversions by
opcode; over int8 a second count with the package's per-value scale multiply taken out of `paged_kv` (a fork of its
source, the numbers wrong, compiled only): the floor that folding the scales into the scores and probabilities could
reach. Then, over bf16 and fp8, the registers a thread and the stack (ptxas's spills) of the engine's launch and
of the lab's variants (64-key tiles, 8 warps, the products on the CUDA cores). Writes kv_ptx_cpu.json. Static counts
predict the instruction stream, not the time: the H200 decides (`kernels/kv_fp8_h200.py --caches fp8,int8 --parts
kernel`). `--smoke` compiles the int8 kernel only.
This script runs no kernel, so it never uses the interpreter: it imports the package with TRITON_INTERPRET=0.
"""
import os, sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"      # compile for sm_90, never interpret: set before nanoserve is imported
import nanoserve.attention as A           # noqa: E402  (before lab, which turns the interpreter on under --smoke)

sys.path.insert(0, str(Path(__file__).parent))
from lab import disassemble, is_smoke, parser, write   # noqa: E402
os.environ["TRITON_INTERPRET"] = "0"      # (lab's --smoke switch is for scripts that run kernels)

import re                                 # noqa: E402
from collections import Counter           # noqa: E402

import triton                             # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource     # noqa: E402

HEADS = dict(NUM_HEADS=16, G=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=16, TILE_N=128, NUM_SPLITS=4, MERGE=True,
             UPCAST=False, ROPE=True, QK_NORM=True, PDL=True, DOT_PRECISION="tf32", BY_CONTEXT=True, PREFETCH=True,
             AHEAD=0, FMA=False, SCATTER=False)
SCALED = "k, v = k.to(tl.float32) * ks[:, None], v.to(tl.float32) * vs[:, None]"


def compiled(kernel, cache: str, consts: dict = HEADS, num_warps: int = 4):
    "Triton's compiled decode kernel over a cache of `cache`'s type, specialised on `consts`, for sm_90."
    ptrs = {n: "*bf16" for n in ("q_ptr", "out_ptr", "cos_ptr", "sin_ptr", "q_norm_ptr", "k_norm_ptr")}
    ptrs.update(k_cache_ptr=cache, v_cache_ptr=cache, block_tables_ptr="*i64", context_lens_ptr="*i64",
                part_out_ptr="*fp32", part_lse_ptr="*fp32", counter_ptr="*i32", slot_mapping_ptr="*i64")
    sig, cst, attrs = {}, {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in ptrs: sig[n] = ptrs[n]; attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in consts: sig[n] = "constexpr"; cst[(i,)] = consts[n]
        else: sig[n] = "fp32" if n in ("scale_log2", "eps") else "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=cst, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def compile_ptx(kernel, cache: str) -> str: return compiled(kernel, cache).asm["ptx"]


# (label, constexprs over HEADS, warps): the engine's launch, then the lab's knobs (`decode_attention(tile=, fma=,
# num_warps=)`); the FMA products take the query group unpadded
FMA_GROUP = {"FMA": True, "BLOCK_G": 2}
RESOURCE_VARIANTS = (("engine: 128-key tiles", {}, 4), ("64-key tiles", {"TILE_N": 64}, 4),
                     ("128-key tiles, 8 warps", {}, 8), ("fma, 32-key tiles", {**FMA_GROUP, "TILE_N": 32}, 4),
                     ("fma, 64-key tiles, 8 warps", {**FMA_GROUP, "TILE_N": 64}, 8))


def resources(cache: str) -> list[dict]:
    "Registers a thread and stack bytes (ptxas's spills) of each variant over `cache`, from the compiled cubin."
    out = []
    for label, over, warps in RESOURCE_VARIANTS:
        _, usage = disassemble(compiled(A.decode_attention_kernel, cache, {**HEADS, **over}, warps).asm["cubin"])
        out.append({"variant": label, "num_warps": warps, "registers": usage["REG"],
                    "stack_bytes": usage.get("STACK", 0)})
    return out


def count(ptx: str) -> dict:
    "Instructions (lines that are neither directives, labels, comments nor braces) and conversions by opcode."
    ops = [ln.split()[0] for ln in map(str.strip, ptx.splitlines())
           if ln and not ln.startswith((".", "//", "$", "{", "}", "(", ")"))]
    conv = Counter(op for op in ops if op.startswith(("cvt", "prmt")))
    return {"instructions": len(ops), "conversions": sum(conv.values()), "by_opcode": dict(conv.most_common(8))}


def unscaled_decode_kernel():
    "The decode kernel compiled from a copy of the module's source whose `paged_kv` skips the per-value scale."
    src = Path(A.__file__).read_text()
    assert src.count(SCALED) == 1, "paged_kv's scale multiply moved: update this fork"
    path = Path(__file__).parent / "_kv_ptx_fork.py"            # Triton compiles from a file it can read
    src = src.replace(SCALED, "k, v = k + 0 * ks[:, None].to(k.dtype), v")
    path.write_text(re.sub(r"^from \.(\w*) import", lambda m: f"from nanoserve{'.' + m[1] if m[1] else ''} import",
                           src, flags=re.M))
    try:
        import importlib.util
        spec = importlib.util.spec_from_file_location("_kv_ptx_fork", path)
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        return compile_ptx(mod.decode_attention_kernel, "*i8")
    finally:
        path.unlink()


def main():
    args = parser(__doc__, out="figures/data").parse_args()
    caches = {"int8": "*i8"} if is_smoke(args) else {"bf16": "*bf16", "fp8": "*fp8e4nv", "int8": "*i8"}
    res = {"kernel": "decode_attention_kernel", "constexprs": HEADS, "target": "sm_90 (Triton's ptxas, no GPU)",
           "caches": {name: count(compile_ptx(A.decode_attention_kernel, sig)) for name, sig in caches.items()}}
    if not is_smoke(args):
        res["caches"]["int8 without the per-value scale"] = count(unscaled_decode_kernel())
        res["resources"] = {name: resources(sig) for name, sig in (("bf16", "*bf16"), ("fp8", "*fp8e4nv"))}
        for name, rows in res["resources"].items():
            for r in rows:
                print(f"{name:5s} {r['variant']:28s} {r['registers']:3d} registers, {r['stack_bytes']:5d} B stack")
    for name, c in res["caches"].items(): print(f"{name:34s} {c['instructions']:6,} instructions, "
                                                f"{c['conversions']:5,} conversions {c['by_opcode']}")
    assert re.search(r"s8", " ".join(res["caches"]["int8"]["by_opcode"])), "the int8 kernel widens no bytes?"
    write("kv_ptx_cpu.json", res, args)


if __name__ == "__main__":
    main()

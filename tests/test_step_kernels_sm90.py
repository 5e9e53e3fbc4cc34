"""The kernels of a replayed batch-1 decode step (the decode kernel with RoPE inside, `argmax_rows`, `copy_rows`,
`load_step`, `gemv` with and without the norm), compiled for sm_90 on the CPU (Triton's own ptxas, no GPU): the
interpreter runs their arithmetic in the notebooks, but not the compiler, so a kernel that only fails to compile
would reach the H200 first."""
import json

import pytest
from helpers import compiled_run

STEP_KERNELS = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import nanoserve.attention as A, nanoserve.fused as F

def compile_ptx(kernel, ptrs, ints, consts, num_warps=4):
    sig, cst, attrs = {}, {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in ptrs: sig[n] = ptrs[n]; attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ints: sig[n] = ints[n]
        else: sig[n] = "constexpr"; cst[(i,)] = consts[n]
    src = ASTSource(fn=kernel, signature=sig, constexprs=cst, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]

ptrs = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "cos_ptr", "sin_ptr", "q_norm_ptr",
                              "k_norm_ptr")}
ptrs.update(block_tables_ptr="*i64", context_lens_ptr="*i64", part_out_ptr="*fp32", part_lse_ptr="*fp32",
            counter_ptr="*i32", slot_mapping_ptr="*i64", out_dest_ptr="*i64")
ints = {n: "i32" for n in ("stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_bt", "stride_ot",
                           "stride_oh", "stride_cos")}
ints["scale_log2"] = ints["eps"] = "fp32"
out = {}
def loads_before_wait(ptx: str) -> int:
    "Global loads the PTX issues before its wait on the kernel before (by position in the text)."
    return ptx[:ptx.index("griddepcontrol.wait")].count("ld.global")

for rope in (False, True):          # the 0.5B heads at batch 1: 16 splits merged by the last one
    for prefetch in (True, False):
        ptx = compile_ptx(A.decode_attention_kernel, ptrs, ints, dict(
            NUM_HEADS=14, G=7, BLOCK_G=16, HEAD_DIM=64, BLOCK_SIZE=16, TILE_N=128, NUM_SPLITS=16, MERGE=True,
            UPCAST=False, ROPE=rope, QK_NORM=False, PDL=True, DOT_PRECISION="tf32", BY_CONTEXT=True,
            PREFETCH=prefetch, AHEAD=0, FMA=False, SCATTER=False))
        out[f"decode rope={rope}" + ("" if prefetch else " late")] = {
            "bar": ptx.count("bar.sync"), "st": ptx.count("st.global"), "gdc": ptx.count("griddepcontrol.wait"),
            "early_ld": loads_before_wait(ptx)}
for norm, scatter in ((False, False), (True, False), (False, True)):   # Qwen3-0.6B's heads, RoPE inside
    ptx = compile_ptx(A.decode_attention_kernel, ptrs, ints, dict(
        NUM_HEADS=16, G=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=16, TILE_N=128, NUM_SPLITS=4, MERGE=True,
        UPCAST=False, ROPE=True, QK_NORM=norm, PDL=True, DOT_PRECISION="tf32", BY_CONTEXT=True, PREFETCH=True,
        AHEAD=0, FMA=False, SCATTER=scatter))
    out[f"decode qwen3 norm={norm}" + (" scatter" if scatter else "")] = {
        "rsqrt": ptx.count("rsqrt."), "ld": ptx.count("ld.global"), "early_ld": loads_before_wait(ptx),
        "st": ptx.count("st.global")}
ptx = compile_ptx(F.argmax_rows_kernel, {"x_ptr": "*fp32", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32",
                                         "out_ptr": "*i64", "counter_ptr": "*i32"},
                  {"V": "i32", "stride_x": "i32", "per_part": "i32", "num_parts": "i32"}, dict(BLOCK=1024, BLOCK_PARTS=256))
out["argmax_rows"] = {"atom": ptx.count("atom.global"), "st": ptx.count("st.global")}
ptx = compile_ptx(F.copy_rows_kernel, {"dst_ptr": "*i64", "dst_rows_ptr": "*i64", "src_ptr": "*i64",
                                       "src_rows_ptr": "*i64"}, {"n": "i32"}, dict(BLOCK=256))
out["copy_rows"] = {"st": ptx.count("st.global")}
gptrs = {n: "*bf16" for n in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "res_ptr", "new_res_ptr", "norm_w_ptr")}
gptrs.update(part_ptr="*fp32", counter_ptr="*i32", scale_ptr="*fp32", x_scale_ptr="*fp32")
gints = {"N": "i32", "K": "i32", "tiles_per_split": "i32", "stride_wn": "i32", "eps": "fp32"}
for norm in (False, True):          # the 0.5B QKV (one 1024-wide K tile) and gate/up (four of 256) projections
    for layer, blocks, warps in (("qkv", dict(BLOCK_N=8, BLOCK_K=1024, HAS_BIAS=True), 4),
                                 ("gate_up", dict(BLOCK_N=16, BLOCK_K=256, HAS_BIAS=False), 8)):
        ptx = compile_ptx(F.gemv_kernel, gptrs, gints, dict(ACT=False, SPLIT=False, EVEN=False, NORM=norm,
                                                            HAS_RESIDUAL=norm, ROW=1024, PDL=True, HAS_SCALE=False,
                                                            **blocks), warps)
        out[f"gemv {layer} norm={norm}"] = {"st": ptx.count("st.global"), "gdc": ptx.count("griddepcontrol.wait"),
                                            "sqrt": ptx.count("sqrt.")}
for kept in (False, True):               # dense table rows, or the changes of tables kept on the device
    ptx = compile_ptx(F.load_step_kernel, {n: "*i64" for n in ("packed_ptr", "small_ptr", "tables_ptr", "feed_rows_ptr",
                                                              "samples_ptr", "which_ptr")},
                      {n: "i32" for n in ("bucket", "width", "stride_small", "stride_tables", "num_feeds", "num_rows",
                                          "num_entries")}, dict(BLOCK=256, KEPT=kept))
    out[f"load_step kept={kept}"] = {"st": ptx.count("st.global"), "bar": ptx.count("bar.sync")}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def k():
    "What the compiled kernels' PTX holds, compiled once for both tests."
    return json.loads(compiled_run(STEP_KERNELS, 900).strip().splitlines()[-1])


def test_step_kernels_compile_for_hopper(k):
    """The decode kernel with RoPE and the cache write inside (`ROPE`, with Qwen3's q/k norms too), `argmax_rows`,
    `copy_rows` and `load_step` compile for sm_90 as the engine launches them; the RoPE variant adds the cache stores
    (and keeps a barrier: the owning split's writes, before its threads read a later tile), and keeps waiting for the
    kernel before it. With `PREFETCH` the context length, the block table and the first tile's keys and values load
    before that wait; without it (the control) nothing does. With `SCATTER` (the output stored in the order of the
    layer after it) the destinations load before the wait too, and the stores are as many."""
    plain, rope = k["decode rope=False"], k["decode rope=True"]
    assert rope["bar"] >= 1 and rope["st"] > plain["st"]
    assert rope["gdc"] == plain["gdc"] == 1
    for name in ("decode rope=False", "decode rope=True"):
        assert k[name]["early_ld"] >= 4 and k[name + " late"]["early_ld"] == 0, (k[name], k[name + " late"])
    folded, unfolded = k["decode qwen3 norm=True"], k["decode qwen3 norm=False"]     # Qwen3's q/k norms inside:
    assert folded["rsqrt"] > unfolded["rsqrt"] and folded["ld"] > unfolded["ld"]       # a root, the weights loaded
    scatter = k["decode qwen3 norm=False scatter"]       # the output stored in a layer's order: where each value
    assert scatter["early_ld"] > unfolded["early_ld"] and scatter["st"] == unfolded["st"]   # goes, loaded early
    assert k["argmax_rows"]["atom"] >= 2 and k["argmax_rows"]["st"] >= 3       # counter, reset; partials and result
    assert k["copy_rows"]["st"] >= 1
    for kept in (False, True):                          # integers, feed, table rows (and entries); the barrier
        assert k[f"load_step kept={kept}"]["st"] >= 3 + kept and k[f"load_step kept={kept}"]["bar"] >= 1


def test_gemv_with_norm_compiles_for_hopper(k):
    """`gemv` with the RMSNorm taken in (`NORM`, after a residual) compiles for sm_90 for the 0.5B QKV and gate/up
    projections: it adds the new residual's store and a square root, and still waits for the kernel before it."""
    for layer in ("qkv", "gate_up"):
        plain, norm = k[f"gemv {layer} norm=False"], k[f"gemv {layer} norm=True"]
        assert norm["st"] > plain["st"] and norm["sqrt"] > plain["sqrt"] == 0, (layer, plain, norm)
        assert norm["gdc"] == plain["gdc"] == 1

"""The int8 K/V cache (one fp32 scale per token and KV head, kept after each block's values): the Triton kernels read
it as the torch reference does (values times their rows' scales) and write each new key and value as the reference
quantizes it (bit for bit: the same fp32 operations); an engine with it gives, in every scheduling regime, the greedy
tokens of recomputing each token's logits from scratch over an int8 cache (and so does an fp8 one); about twice
the blocks of a bf16 cache in the same bytes; and, on the trained tiny model, the quantization chapter's quality bar."""
import json

import pytest
import torch

from helpers import ONE_BYTE_SETUPS, check_one_byte_engine
from nanoserve.attention import (decode_attention, decode_attention_ref, prefill_attention, prefill_attention_ref,
                                 rope_cache)
from nanoserve.engine import LLM, SamplingParams
from nanoserve.model import kv_scales, load_model, make_kv_cache, quantize_kv, read_kv
from nanoserve.runner import kv_block_bytes, kv_cache_dtype

TABLES = torch.tensor([[3, 7, 1, 10, 0], [5, 2, 11, 0, 0]])


def paged(num_blocks=12, block_size=4, kvh=2, d=16, seed=0):
    "An int8 K/V cache [num_blocks, block_size, kvh, d] written with random rows of widely different magnitudes."
    g = torch.Generator().manual_seed(seed)
    kc, vc = make_kv_cache(1, num_blocks, block_size, kvh, d, torch.int8)[0]
    for cache in (kc, vc):
        rows = torch.randn(num_blocks * block_size, kvh, d, generator=g) * torch.rand(num_blocks * block_size, kvh, 1,
                                                                                     generator=g) * 20
        values, scales = quantize_kv(rows)
        cache.copy_(values.view(num_blocks, block_size, kvh, d))
        kv_scales(cache).copy_(scales.view(num_blocks, block_size, kvh))
    return kc, vc


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_reads_an_int8_cache_as_the_reference_does(num_splits):
    kc, vc = paged()
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
    ctx = torch.tensor([18, 9])
    out = decode_attention(q, kc, vc, TABLES, ctx, 0.25, 18, num_splits=num_splits)
    torch.testing.assert_close(out, decode_attention_ref(q, kc, vc, TABLES, ctx, 0.25), rtol=1e-5, atol=1e-5)


def test_prefill_reads_an_int8_cache_as_the_reference_does():
    kc, vc = paged()
    q = torch.randn(7 + 5, 4, 16, generator=torch.Generator().manual_seed(3))
    cu, start = torch.tensor([0, 7, 12]), torch.tensor([11, 4])         # each chunk after a cached prefix
    out = prefill_attention(q, kc, vc, TABLES, cu, start, 7, 0.25)
    # values up to ~20 summed in another order (the interpreter's numpy decides it): fp32 agreement, not bits
    torch.testing.assert_close(out, prefill_attention_ref(q, kc, vc, TABLES, cu, start, 0.25), rtol=1e-4, atol=1e-4)


def _written(cache):
    "Slots [num_blocks, block_size] with any value or scale written."
    return (cache != 0).any(-1).any(-1) | (kv_scales(cache) != 0).any(-1)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")     # the padding heads' lanes (masked)
def test_rope_cache_writes_int8_slots_as_the_reference_quantizes():
    T, H, KVH, D = 3, 4, 2, 16
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g) * 3
    ang = torch.rand(T, D // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    (kc, vc), (kr, vr) = make_kv_cache(2, 6, 4, KVH, D, torch.int8)
    slots = torch.tensor([5, 17, -1])                                 # the last token writes nothing
    rope_cache(qkv, cos, sin, slots, kc, vc, H, KVH)
    from nanoserve.attention import rope_cache_ref
    rope_cache_ref(qkv, cos, sin, slots, kr, vr, H, KVH)
    for ours, ref in ((kc, kr), (vc, vr)):
        assert torch.equal(_written(ours).nonzero(), torch.tensor([[1, 1], [4, 1]]))    # slots 5 and 17, nothing else
        assert torch.equal(ours, ref) and torch.equal(kv_scales(ours), kv_scales(ref))   # the same fp32 operations


def test_decode_with_rope_writes_the_new_int8_slot_then_reads_it():
    H, KVH, D = 4, 2, 16
    kc, vc = paged()
    ctx = torch.tensor([18, 9])                                       # the new tokens sit at positions 17 and 8
    slots = torch.tensor([0 * 4 + 1, 11 * 4 + 0])                   # block 0 offset 1; block 11 offset 0
    qkv = torch.randn(2, (H + 2 * KVH) * D, generator=torch.Generator().manual_seed(5)) * 4
    cos, sin = torch.ones(2, D // 2), torch.zeros(2, D // 2)          # no rotation: the stored rows are the inputs
    out = torch.empty(2, H, D)
    decode_attention(None, kc, vc, TABLES, ctx, 0.25, 18, num_splits=4, out=out, rope=(qkv, cos, sin, slots))
    k = qkv[:, H * D:(H + KVH) * D].view(2, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(2, KVH, D)
    for b, (blk, off) in enumerate(((0, 1), (11, 0))):
        assert torch.equal(kc[blk, off], quantize_kv(k[b])[0]) and torch.equal(vc[blk, off], quantize_kv(v[b])[0])
        assert torch.equal(kv_scales(kc)[blk, off], quantize_kv(k[b])[1])
    q = qkv[:, :H * D].view(2, H, D)
    torch.testing.assert_close(out, decode_attention_ref(q, kc, vc, TABLES, ctx, 0.25), rtol=1e-5, atol=1e-5)


def test_read_kv_gives_each_row_within_half_a_step():
    x = torch.randn(5, 4, 2, 16) * torch.tensor([0.01, 1.0, 100.0, 0.0]).view(1, 4, 1, 1)   # one block a token row
    kc = make_kv_cache(1, 5, 4, 2, 16, torch.int8)[0, 0]
    values, scales = quantize_kv(x)
    kc.copy_(values); kv_scales(kc).copy_(scales)
    back = read_kv(kc, torch.arange(5), torch.float32)
    assert ((back - x).abs() <= scales[..., None] / 2 + 1e-6 * x.abs()).all()
    assert torch.equal(back[:, 3], torch.zeros(5, 2, 16))             # an all-zero row: scale 0, values 0


@pytest.mark.parametrize("cache", ["fp8", "int8"])
@pytest.mark.parametrize("setup", ONE_BYTE_SETUPS)
def test_a_one_byte_engine_gives_the_recomputed_tokens(random_qwen2, setup, cache):
    check_one_byte_engine(random_qwen2, setup, cache)


def test_one_byte_blocks(random_qwen2):
    "fp8: half a bf16 block; int8: a byte a value and a 4-byte scale a row, all of it in the cache's allocation."
    model = load_model(random_qwen2, dtype=torch.bfloat16)
    fp8, int8, bf16 = (kv_cache_dtype(c, torch.bfloat16) for c in ("fp8", "int8", "auto"))
    D = model.config.head_dim
    assert kv_block_bytes(model, 16, bf16) == 2 * kv_block_bytes(model, 16, fp8)
    assert kv_block_bytes(model, 16, bf16) * (D + 4) == 2 * D * kv_block_bytes(model, 16, int8)
    cache = make_kv_cache(model.config.num_hidden_layers, 3, 16, model.config.num_key_value_heads, D, int8)
    assert cache.untyped_storage().nbytes() == 3 * kv_block_bytes(model, 16, int8)    # what the budget counts


def test_the_command_lines_and_the_limit_know_int8():
    from nanoserve import bench, server
    from nanoserve.bench import BenchRequest, physical_limit
    from nanoserve.tokenizer import default_model
    args = ["--kv-cache-dtype", "int8"]
    assert bench.engine_kwargs_from_args(bench.build_parser().parse_args(args))["kv_cache_dtype"] == "int8"
    assert server.engine_kwargs(server.build_parser().parse_args(args))["kv_cache_dtype"] == "int8"
    reqs = [BenchRequest(tuple(range(40)), 8)] * 4
    auto = physical_limit(default_model(), reqs, {"device": "cpu"})
    int8 = physical_limit(default_model(), reqs, {"device": "cpu", "kv_cache_dtype": "int8"})
    D = load_model(default_model(), dtype=torch.float32).config.head_dim
    assert int8["kv_bytes"] * 4 == pytest.approx(auto["kv_bytes"] * (1 + 4 / D))     # fp32 on a CPU: 4 bytes a value


INT8_KERNELS = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import nanoserve.attention as A

def compile_ptx(kernel, ptrs, consts):
    sig, cst, attrs = {}, {}, {}
    for i, n in enumerate(kernel.arg_names):
        if n in ptrs: sig[n] = ptrs[n]; attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in consts: sig[n] = "constexpr"; cst[(i,)] = consts[n]
        else: sig[n] = "fp32" if n in ("scale_log2", "eps") else "i32"
    src = ASTSource(fn=kernel, signature=sig, constexprs=cst, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

out = {}
for cache in ("*i8", "*bf16"):
    ptrs = {n: "*bf16" for n in ("q_ptr", "out_ptr", "cos_ptr", "sin_ptr", "q_norm_ptr", "k_norm_ptr", "qkv_ptr",
                                  "q_out_ptr")}
    ptrs.update(k_cache_ptr=cache, v_cache_ptr=cache, block_tables_ptr="*i64", context_lens_ptr="*i64",
                part_out_ptr="*fp32", part_lse_ptr="*fp32", counter_ptr="*i32", slot_mapping_ptr="*i64",
                cu_q_lens_ptr="*i64", start_pos_ptr="*i64", tile_map_ptr="*i64")
    for rope in (False, True):      # Qwen3-0.6B's heads, its q/k norms inside
        ptx = compile_ptx(A.decode_attention_kernel, ptrs, dict(
            NUM_HEADS=16, G=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=16, TILE_N=128, NUM_SPLITS=4, MERGE=True,
            UPCAST=False, ROPE=rope, QK_NORM=rope, PDL=True, DOT_PRECISION="tf32", BY_CONTEXT=True, PREFETCH=True,
            AHEAD=0, FMA=False, SCATTER=False))
        out[f"decode {cache} rope={rope}"] = {"cvt_s8": len(re.findall(r"cvt\.[\w.]*s8\b", ptx)),
                                               "st": ptx.count("st.global"), "ld": ptx.count("ld.global")}
    ptx = compile_ptx(A.rope_cache_kernel, ptrs, dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16,
                                                      BLOCK_H=16, UPCAST=False, QK_NORM=True, PDL=True))
    out[f"rope_cache {cache}"] = {"st": ptx.count("st.global")}
    ptx = compile_ptx(A.prefill_attention_kernel, ptrs, dict(G=2, BLOCK_G=2, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=64,
                                                             TILE_N=64, TILED=True, UPCAST=False, DOT_PRECISION="tf32"))
    out[f"prefill {cache}"] = {"ld": ptx.count("ld.global")}
print(json.dumps(out))
"""


def test_int8_kernels_compile_for_hopper():
    """The decode kernel (with RoPE and the write inside, and without), `rope_cache` and the prefill kernel compile
    for sm_90 over an int8 cache (Triton's own ptxas on the CPU, no GPU): the interpreter runs their arithmetic above,
    not the compiler. Over int8 they widen bytes (the `s8` conversions) and load the rows' scales, and the writers
    store the scales."""
    from helpers import compiled_run
    k = json.loads(compiled_run(INT8_KERNELS, 900).strip().splitlines()[-1])
    for rope in (False, True):
        i8, bf = k[f"decode *i8 rope={rope}"], k[f"decode *bf16 rope={rope}"]
        assert i8["ld"] >= bf["ld"] and i8["cvt_s8"] > 0 == bf["cvt_s8"], (i8, bf)
    assert k["decode *i8 rope=True"]["st"] > k["decode *bf16 rope=True"]["st"]        # the scales of the new row
    assert k["rope_cache *i8"]["st"] > k["rope_cache *bf16"]["st"]


def test_two_ranks_with_an_int8_cache_give_the_tokens_of_one():
    "Tensor parallel: each rank's cache holds its half of the KV heads, each row with its own scale, as one process's."
    from nanoserve.tokenizer import default_model
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self"]
    GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    one = [o.token_ids for o in LLM(default_model(), dtype="float32", kv_cache_dtype="int8").generate(prompts, GREEDY)]
    llm2 = LLM(default_model(), dtype="float32", kv_cache_dtype="int8", tensor_parallel_size=2)
    try:
        assert llm2.runner.kv_cache.dtype == torch.int8
        assert [o.token_ids for o in llm2.generate(prompts, GREEDY)] == one
    finally:
        llm2.close()

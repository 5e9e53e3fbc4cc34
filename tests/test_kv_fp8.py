"""The fp8 (e4m3) K/V cache: the Triton kernels read it exactly as the torch reference does and write each new key
and value into its slot as torch rounds it; the engine's regimes and the blocks' bytes are
`test_kv_int8.py`'s, for both one-byte caches.

The interpreter rounds some fp32 values to fp8 wrongly (a carry into the exponent is dropped), so the write tests
use values that are already fp8 numbers (no rounding left to do) and an identity rotation; the kernels' rounding
itself is checked on the GPU (`kernels/kv_fp8_h200.py`)."""
import pytest
import torch

from nanoserve.attention import decode_attention, decode_attention_ref, prefill_attention, prefill_attention_ref, rope_cache
from nanoserve.engine import LLM

FP8 = torch.float8_e4m3fn


def on_grid(*shape, seed=0, scale=2.0):
    "fp32 values that are fp8 numbers already: rounding them to fp8 changes nothing."
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(FP8).float()


def paged(num_blocks=12, block_size=4, kvh=2, d=16, seed=0):
    "An fp8 K/V cache [num_blocks, block_size, kvh, d] full of fp8 values (the tests give each sequence its blocks)."
    kc, vc = on_grid(num_blocks, block_size, kvh, d, seed=seed).to(FP8), on_grid(num_blocks, block_size, kvh, d, seed=seed + 1).to(FP8)
    return kc, vc


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_reads_an_fp8_cache_as_the_reference_does(num_splits):
    kc, vc = paged()
    tables = torch.tensor([[3, 7, 1, 10, 0], [5, 2, 11, 0, 0]])
    ctx = torch.tensor([18, 9])
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
    out = decode_attention(q, kc, vc, tables, ctx, 0.25, 18, num_splits=num_splits)
    torch.testing.assert_close(out, decode_attention_ref(q, kc, vc, tables, ctx, 0.25), rtol=1e-5, atol=1e-5)


def test_prefill_reads_an_fp8_cache_as_the_reference_does():
    kc, vc = paged()
    tables = torch.tensor([[3, 7, 1, 10, 0], [5, 2, 11, 0, 0]])
    q = torch.randn(7 + 5, 4, 16, generator=torch.Generator().manual_seed(3))
    cu, start = torch.tensor([0, 7, 12]), torch.tensor([11, 4])         # each chunk after a cached prefix
    out = prefill_attention(q, kc, vc, tables, cu, start, 7, 0.25)
    torch.testing.assert_close(out, prefill_attention_ref(q, kc, vc, tables, cu, start, 0.25), rtol=1e-5, atol=1e-5)


def _qkv_on_grid(T, H, KVH, D, seed=4):
    return on_grid(T, (H + 2 * KVH) * D, seed=seed)


def test_rope_cache_writes_fp8_slots_as_torch_rounds():
    T, H, KVH, D = 3, 4, 2, 16
    qkv = _qkv_on_grid(T, H, KVH, D)
    cos, sin = torch.ones(T, D // 2), torch.zeros(T, D // 2)          # no rotation: the stored values are the inputs
    kc, vc = torch.zeros(6, 4, KVH, D, dtype=FP8), torch.zeros(6, 4, KVH, D, dtype=FP8)
    slots = torch.tensor([5, 17, -1])                                 # the last token writes nothing
    rope_cache(qkv, cos, sin, slots, kc, vc, H, KVH)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    for t, s in enumerate(slots.tolist()[:2]):
        assert torch.equal(kc.view(-1, KVH, D)[s].view(torch.uint8), k[t].to(FP8).view(torch.uint8))
        assert torch.equal(vc.view(-1, KVH, D)[s].view(torch.uint8), v[t].to(FP8).view(torch.uint8))
    assert int((kc.view(torch.uint8) != 0).sum()) == int((k[:2].to(FP8).view(torch.uint8) != 0).sum())


def test_decode_with_rope_writes_the_new_fp8_slot_then_reads_it():
    H, KVH, D = 4, 2, 16
    kc, vc = paged()
    tables = torch.tensor([[3, 7, 1, 10, 0], [5, 2, 11, 0, 0]])
    ctx = torch.tensor([18, 9])                                       # the new tokens sit at positions 17 and 8
    slots = torch.tensor([0 * 4 + 1, 11 * 4 + 0])                   # block 0 offset 1; block 11 offset 0
    qkv = _qkv_on_grid(2, H, KVH, D)
    cos, sin = torch.ones(2, D // 2), torch.zeros(2, D // 2)
    out = torch.empty(2, H, D)
    decode_attention(None, kc, vc, tables, ctx, 0.25, 18, num_splits=4, out=out, rope=(qkv, cos, sin, slots))
    k = qkv[:, H * D:(H + KVH) * D].view(2, KVH, D)
    for b, s in enumerate(slots.tolist()):
        assert torch.equal(kc.view(-1, KVH, D)[s].view(torch.uint8), k[b].to(FP8).view(torch.uint8))
    q = qkv[:, :H * D].view(2, H, D)
    torch.testing.assert_close(out, decode_attention_ref(q, kc, vc, tables, ctx, 0.25), rtol=1e-5, atol=1e-5)


def test_a_bad_cache_dtype_is_refused_before_loading():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(kv_cache_dtype="fp4")


def test_the_command_lines_pass_the_cache_dtype():
    from nanoserve import bench, server
    assert bench.engine_kwargs_from_args(bench.build_parser().parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in bench.engine_kwargs_from_args(bench.build_parser().parse_args([]))
    assert server.engine_kwargs(server.build_parser().parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--kv-cache-dtype", "fp4"])


def test_the_benchmarks_limit_counts_one_byte_a_cached_value():
    from nanoserve.bench import BenchRequest, physical_limit
    from nanoserve.tokenizer import default_model
    reqs = [BenchRequest(tuple(range(40)), 8)] * 4
    auto = physical_limit(default_model(), reqs, {"device": "cpu"})
    fp8 = physical_limit(default_model(), reqs, {"device": "cpu", "kv_cache_dtype": "fp8"})
    assert fp8["kv_bytes"] * 4 == auto["kv_bytes"]          # fp32 on a CPU: 4 bytes a value against 1
    assert fp8["weight_bytes"] == auto["weight_bytes"]

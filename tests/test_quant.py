"""Weight-only quantization (nanoserve.quant): formats, the Triton GEMV/GEMM kernels through the interpreter,
QuantLinear, quantize_model on a small random Qwen2. The chapter nbs/08_quant.ipynb has the same checks inline,
with the quality and memory measurements."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"           # before anything defines a Triton kernel

import pytest
import torch.nn.functional as F
from torch import nn

from nanoserve.model import AttentionMetadata, ModelConfig, PrefillChunk, Qwen2ForCausalLM

from helpers import compiled_run
from nanoserve.quant import (METHODS, QUANT_TARGETS, QuantEmbedding, QuantLinear, QuantReport, quant_tables, choose_split_k, dequantize_int4, dequantize_int8, gemm_config, gemv_config,
                             kernels_support, pack_int4, quant_gemm, quant_gemv,
                             quant_matmul, quant_matmul_ref, quantize_int4, quantize_int8, quantize_model,
                             quantized_linear_bytes, unpack_int4, weight_bytes, words_path, gemv_launch,
                             gemv_tile, int4_rows, tile_int4, weight_layout)

# the package's tuning tables (nanoserve/tables/quant.json), read-only
TUNED_GEMV, FEW_ROWS_GEMM, GEMV_MAX_T = (quant_tables()[k] for k in ("tuned_gemv", "few_rows_gemm", "gemv_max_t"))

interp = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for CPU machines")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- formats -----------------------------------------------------------------------------------------------------

def test_pack_unpack_all_values():
    v = torch.arange(16, dtype=torch.uint8)
    pairs = torch.cartesian_prod(v, v).reshape(2, -1)                        # [2, 256]: every (low, high) pair
    assert torch.equal(unpack_int4(pack_int4(pairs)), pairs)
    assert pack_int4(torch.tensor([[15, 0, 0, 15]])).tolist() == [[15, 240]]


def test_int8_round_trip_within_half_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 96, generator=g) * torch.logspace(-4, 2, 7)[:, None]
    w[3] = 0
    q, s = quantize_int8(w.to(torch.bfloat16))
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (7,)
    err = (dequantize_int8(q, s) - w.to(torch.bfloat16).float()).abs().amax(1)
    assert (err <= s / 2 * (1 + 1e-5)).all()
    assert int(q.abs().max()) == 127 and dequantize_int8(q, s)[3].abs().max() == 0


@pytest.mark.parametrize("G", [2, 16, 64, 128])
def test_int4_round_trip_within_half_step_per_group(G):
    g = torch.Generator().manual_seed(G)
    w = torch.randn(9, 256, generator=g)
    w[1] += 4.0                    # all positive
    w[2] -= 4.0                    # all negative
    w[3] = 0.0
    w[4, :G] = 0.7                 # constant group
    qw, s, z = quantize_int4(w, G)
    assert qw.shape == (9, 128) and qw.dtype == torch.uint8 and s.shape == z.shape == (9, 256 // G)
    assert int(z.max()) <= 15
    err = (dequantize_int4(qw, s, z, G) - w).abs().reshape(9, -1, G).amax(-1)
    assert (err <= s / 2 * (1 + 1e-5) + 1e-7).all()
    assert dequantize_int4(qw, s, z, G)[3].abs().max() == 0


def test_int4_bad_group_sizes():
    w = torch.randn(4, 96)
    for G, msg in ((64, "group_size 64 does not divide in_features 96"), (0, "even"), (3, "even"), (-2, "even")):
        with pytest.raises(ValueError, match=msg): quantize_int4(w, G)


# -- kernels, through the interpreter ------------------------------------------------------------------------------

def _case(method, K, G, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    N = 200
    w = torch.randn(N, K, generator=g) * 0.05
    packed = quantize_int8(w) + (None,) if method == "int8" else quantize_int4(w, G)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return packed, b, g


SPLIT_CFG = {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 3}         # several K tiles and splits on small shapes


def _check(out, ref, dtype, T, name):
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert out.dtype == dtype and out.shape == (T, 200), name
    rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert rel < tol, (name, T, rel)


@interp
@interp
@pytest.mark.parametrize("method,cfg", [("int4", {"ZPAIR": True}), ("int4", {"DOT": True}), ("int8", {"F16": True}),
                                        ("int8", {"F16": True, "BLOCK_K": 64, "SPLIT_K": 3})])
def test_one_row_packed_paths_are_exact_on_integers(method, cfg):
    """The packed one-row paths (under the interpreter, their emulations) on weights with unit scales and sparse
    activations of +-1, where every product and sum is an integer small enough for bf16: the output must equal the
    reference exactly, so a nibble or byte out of place, a wrong zero point, sign or scale cannot hide in a
    tolerance. INT8 runs its full byte range (two activations) and small bytes (sixteen)."""
    g = torch.Generator().manual_seed(7)
    N, K, G = 64, 512, 128
    cfg = {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2, **cfg}
    if method == "int4":
        cfg |= {"WORDS": True, "HALF2": True}
        cases = [(torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8), torch.ones(N, K // G),
                  torch.randint(0, 16, (N, K // G), generator=g, dtype=torch.uint8), 16)]
    else:
        cases = [(torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8), torch.ones(N), None, 2),
                 (torch.randint(-8, 9, (N, K), generator=g, dtype=torch.int8), torch.ones(N), None, 16)]
    run = gemv_launch(1, N, K, method, G if method == "int4" else None, torch.bfloat16, 132, cfg)["constexprs"]
    assert run["EMULATE"] and (run["HALF2"] or run["F16"])
    for qweight, scales, zeros, nonzero in cases:
        x = torch.zeros(1, K)
        where = torch.randperm(K, generator=g)[:nonzero]
        x[0, where] = torch.randint(0, 2, (nonzero,), generator=g).float() * 2 - 1
        x = x.to(torch.bfloat16)
        group = G if method == "int4" else None
        ref = quant_matmul_ref(x.float(), qweight, scales, zeros, None, method, group)
        assert ref.abs().max() <= 256 and ref.abs().max() > 0
        out = quant_gemv(x, qweight, scales, zeros, None, method, group, config=cfg)
        assert torch.equal(out.float(), ref), (out.float() - ref).abs().max()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("K,G", [(256, 64), (384, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_reference(method, K, G, dtype):
    "The FMA GEMV path at 1-4 rows: its own rules, forced K tiles + splits, one split; quant_matmul dispatches here."
    packed, b, g = _case(method, K, G, dtype, True, K + G)
    for T in (1, 2, 3, 4):
        x = torch.randn(T, K, generator=g).to(dtype)
        bias = b if T % 2 else None                           # with a bias at 1 and 3 rows, without at 2 and 4
        ref = quant_matmul_ref(x.float(), *packed, bias, method, G)
        for name, kw in (("gemv", {}), ("gemv-split", {"config": SPLIT_CFG}), ("gemv-1", {"split_k": 1})):
            _check(quant_gemv(x, *packed, bias, method, G, **kw), ref, dtype, T, name)
        _check(quant_matmul(x, *packed, bias, method, G), ref, dtype, T, "auto")


@interp
@pytest.mark.parametrize("G,BLOCK_K,SPLIT_K", [(64, 64, 3), (64, 128, 2), (64, 256, 1), (32, 128, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_words_path_matches_reference(G, BLOCK_K, SPLIT_K, dtype):
    "INT4 at one row as words of nibbles: 1, 2 or 4 groups a K tile, split or not, with and without a bias."
    K, N = 512, 64
    g = torch.Generator().manual_seed(G + BLOCK_K)
    packed = quantize_int4(torch.randn(N, K, generator=g) * 0.05, G)
    cfg = {"WORDS": True, "BLOCK_N": 16, "BLOCK_K": BLOCK_K, "SPLIT_K": SPLIT_K}
    assert words_path(1, N, K, "int4", G, cfg)
    for bias in (None, torch.randn(N, generator=g).to(dtype)):
        x = torch.randn(1, K, generator=g).to(dtype)
        ref = quant_matmul_ref(x.float(), *packed, bias, "int4", G)
        out = quant_gemv(x, *packed, bias, "int4", G, config=cfg)
        rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert out.dtype == dtype and rel < (1e-5 if dtype == torch.float32 else 2e-3), rel
        # the packed-pairs (PTX) variant runs on a GPU only: under the interpreter it is the words path, exactly
        assert torch.equal(quant_gemv(x, *packed, bias, "int4", G, config={**cfg, "HALF2": True}), out)


@interp
@pytest.mark.parametrize("extra", [{}, {"DOT": True}], ids=["zpair", "dot"])
@pytest.mark.parametrize("G,N,BLOCK_N,SPLIT_K", [(64, 64, 16, 3), (128, 48, 16, 1), (32, 32, 32, 4)])
def test_gemv_zero_point_pairs_matches_reference(G, N, BLOCK_N, SPLIT_K, extra):
    """INT4 packed pairs with the zero point inside the pairs (`ZPAIR`), or dequantized by the same trick for the
    tensor cores (`DOT`): under the interpreter `_pairs_emulated` / `_dequant_words` stand in for the PTX, so the
    loads, the activation pairs (`_x_pairs`), the zero-point pairs and the nibble order are checked here against
    the reference, in bf16 (the only dtype the paths take)."""
    K = 512
    g = torch.Generator().manual_seed(G + N)
    packed = quantize_int4(torch.randn(N, K, generator=g) * 0.05, G)
    assert packed[2].unique().numel() > 4                                   # zero points that differ
    cfg = {"WORDS": True, "HALF2": True, "ZPAIR": True, "BLOCK_N": BLOCK_N, "BLOCK_K": G, "SPLIT_K": SPLIT_K, **extra}
    assert gemv_launch(1, N, K, "int4", G, torch.bfloat16, 132, cfg)["constexprs"]["EMULATE"]
    for bias in (None, torch.randn(N, generator=g).to(torch.bfloat16)):
        x = (torch.randn(1, K, generator=g) * 4).to(torch.bfloat16)
        ref = quant_matmul_ref(x.float(), *packed, bias, "int4", G)
        for _ in range(2):                                                  # the split counters are reused
            out = quant_gemv(x, *packed, bias, "int4", G, config=cfg)
            rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            assert out.dtype == torch.bfloat16 and rel < 8e-3, rel          # the output's bf16 rounding
        shifted = (packed[0], packed[1], (packed[2].int() + 1).clamp(max=15).to(packed[2].dtype))
        assert not torch.equal(quant_gemv(x, *shifted, bias, "int4", G, config=cfg), out)  # z is read
    wide = torch.zeros(1, K + 1, dtype=torch.bfloat16)
    wide[:, 1:] = x
    view = wide[:, 1:]                                                      # 2 bytes past an int32 boundary
    assert view.data_ptr() % 4 and torch.equal(quant_gemv(view, *packed, bias, "int4", G, config=cfg), out)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("K,G", [(256, 64), (384, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_matches_reference(method, K, G, dtype):
    "The tensor-core path (INT4: nibbles interleaved in registers, one dot) at 5-40 rows, split-K by rule and off."
    packed, b, g = _case(method, K, G, dtype, True, K + G + 1)
    for T in (1, 5, 17, 40):
        x = torch.randn(T, K, generator=g).to(dtype)
        bias = b if T in (5, 40) else None
        ref = quant_matmul_ref(x.float(), *packed, bias, method, G)
        _check(quant_gemm(x, *packed, bias, method, G), ref, dtype, T, "gemm")
        _check(quant_gemm(x, *packed, bias, method, G, split_k=1), ref, dtype, T, "gemm-1")
        _check(quant_gemm(x, *packed, bias, method, G, config={"BLOCK_M": 16, "BLOCK_N": 32}), ref, dtype, T,
               "gemm-small-tiles")
        if T > GEMV_MAX_T: _check(quant_matmul(x, *packed, bias, method, G), ref, dtype, T, "auto")


@interp
@pytest.mark.parametrize("K,G,N", [(256, 64, 72), (384, 128, 40)])
def test_gemm_packed_words_match_reference(K, G, N):
    """The INT4 GEMM reading words and dequantizing in packed pairs (`PACKED`; the interpreter emulates the PTX),
    at 5-40 rows, with a bias, split-K, a ragged last channel tile; a zero point off by one changes the output."""
    from nanoserve.quant import gemm_launch
    torch.manual_seed(1)
    packed = quantize_int4(torch.randn(N, K) * 0.05, G)
    bias = torch.randn(N)
    assert gemm_launch(8, N, K, "int4", G, 132, {"PACKED": True}, interpret=True, dtype=torch.float32)["constexprs"]["PACKED"]
    assert not gemm_launch(8, N, K, "int4", G, 132, {"PACKED": True}, interpret=False,
                           dtype=torch.float16)["constexprs"]["PACKED"]          # the GPU's PTX: bf16 only
    for T, split, bn in ((5, None, 32), (17, 1, 64), (40, 3, 32)):
        x = torch.randn(T, K)
        ref = quant_matmul_ref(x, *packed, bias, "int4", G)
        cfg = {"PACKED": True, "BLOCK_N": bn, "BLOCK_K": min(G, 64)}
        out = quant_gemm(x, *packed, bias, "int4", G, split_k=split, config=cfg)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    shifted = (packed[0], packed[1], (packed[2].int() + 1).clamp(max=15).to(packed[2].dtype))
    assert not torch.allclose(quant_gemm(x, *shifted, bias, "int4", G, config=cfg), out, atol=1e-3)


@interp
@interp
@pytest.mark.parametrize("N,K,G,tile", [(256, 512, 128, 64), (192, 384, 64, 32)])
def test_tiled_layout_every_path_matches_rows(N, K, G, tile):
    """`tile_int4`'s layout through each kernel path (one-row words in bf16 pairs and in fp32, the plain GEMV with
    splits, the packed and unpacked GEMM) gives what the row-major weights give, and both match the reference."""
    g = torch.Generator().manual_seed(N)
    w = torch.randn(N, K, generator=g) * 0.05
    q = quantize_int4(w, G)
    tq = tile_int4(*q, G, tile)
    assert weight_layout(tq[0])[0] == tile and weight_layout(q[0])[0] == 0
    words = {"WORDS": True, "HALF2": True, "ZPAIR": True, "BLOCK_N": tile, "BLOCK_K": G, "PAIRS": False}
    for T in (1, 3, 17):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(T, K, generator=g).to(dtype)
            ref = quant_matmul_ref(x.float(), *q, None, "int4", G)
            runs = {"auto": lambda p: quant_matmul(x, *p, None, "int4", G)}
            if T <= GEMV_MAX_T:
                runs["words"] = lambda p: quant_gemv(x, *p, None, "int4", G, config=words)
                runs["plain"] = lambda p: quant_gemv(x, *p, None, "int4", G, config={"BLOCK_N": 16, "BLOCK_K": G,
                                                                                      "SPLIT_K": 2})
            else:
                runs["packed"] = lambda p: quant_gemm(x, *p, None, "int4", G)
                runs["unpacked"] = lambda p: quant_gemm(x, *p, None, "int4", G, config={"PACKED": False,
                                                                                         "BLOCK_N": 32})
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for name, run in runs.items():
                a, b = run(tq).float(), run(q).float()
                assert ((a - b).abs().max() / ref.abs().max()).item() < tol, (name, T, dtype)
                assert ((a - ref).abs().max() / ref.abs().max()).item() < tol, (name, T, dtype)


def test_quant_linear_takes_the_tiled_layout_where_the_table_asks():
    "A layer whose one-row GEMV reads words in tiles stores them tiled; its dequantized weight is unchanged."
    lin = nn.Linear(256, 128, bias=True)
    assert gemv_tile(128, 256, 64) == 64 and gemv_tile(128, 256, 96) == 0 and gemv_tile(100, 256, 64) == 0
    ql = QuantLinear.from_linear(lin, "int4", 64)
    assert ql.qweight.shape == (2, 64, 4, 32) and ql.scales.stride() == (1, 128)
    q = quantize_int4(lin.weight.detach(), 64)
    assert torch.equal(int4_rows(ql.qweight), q[0]) and torch.equal(ql.scales, q[1]) and torch.equal(ql.zeros, q[2])
    assert torch.equal(ql.dequantized_weight(), dequantize_int4(*q, 64))
    rows = QuantLinear.from_linear(nn.Linear(256, 100), "int4", 64)            # 100 channels: no tile fits
    assert rows.qweight.shape == (100, 128)


def test_gemv_split_edge_cases():
    torch.manual_seed(0)
    packed = quantize_int4(torch.randn(64, 256), 64)
    x = torch.randn(2, 256)
    ref = quant_matmul_ref(x, *packed, None, "int4", 64)
    for split in (1, 2, 3, 4, 99):                       # 4 K tiles: 3 splits of (2, 2, 0) become 2; 99 becomes 4
        torch.testing.assert_close(quant_gemv(x, *packed, None, "int4", 64, split_k=split, config={"BLOCK_K": 64}),
                                   ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(quant_gemm(x, *packed, None, "int4", 64, split_k=split, config={"BLOCK_K": 64}),
                                   ref, atol=1e-5, rtol=1e-5)
    assert quant_gemv(torch.randn(0, 256), *packed, None, "int4", 64).shape == (0, 64)
    assert quant_gemm(torch.randn(0, 256), *packed, None, "int4", 64).shape == (0, 64)
    xs = torch.randn(4, 512)[:, ::2]                                            # non-contiguous rows: copied
    torch.testing.assert_close(quant_gemv(xs, *packed, None, "int4", 64), quant_matmul_ref(xs, *packed, None, "int4", 64),
                               atol=1e-5, rtol=1e-5)
    q8 = quantize_int8(torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None])   # every int8 value incl. -127
    ref8 = quant_matmul_ref(x, *q8, None, None, "int8")
    assert ((quant_gemv(x, *q8, None, None, "int8") - ref8).abs() / ref8.abs().amax(0)).max() < 1e-5   # per channel


def test_split_rule_depends_on_shapes_only():
    assert choose_split_k(1, 3584, 18944, 4, 64, 128, 132) == 10       # 7B down_proj, 64-channel tiles of 128 inputs
    assert choose_split_k(1, 37888, 3584, 4, 64, 128, 132) == 1        # 7B gate_up_proj: enough output tiles
    for M in (1, 8, 32):
        for N, K in ((896, 4864), (1152, 896), (4608, 3584)):
            s = choose_split_k(M, N, K, 4, 64, 128, 132)
            tiles = -(-K // 128)
            assert 1 <= s <= min(16, tiles) and -(-tiles // -(-tiles // s)) == s    # no empty splits


def test_configs_and_overrides():
    assert len(TUNED_GEMV) == 17 and all(k in TUNED_GEMV for k in FEW_ROWS_GEMM)    # the package ships the H200 table
    down = gemv_config(1, 3584, 18944, "int4", 128, 132)                         # ... and uses it: the words path
    assert (down["BLOCK_N"], down["BLOCK_K"], down["WORDS"], down["HALF2"], down["TILED"]) == (32, 128, True, True, True)
    assert words_path(1, 3584, 18944, "int4", 128, down) and not words_path(2, 3584, 18944, "int4", 128, down)
    assert (gemv_tile(3584, 18944, 128), gemv_tile(4608, 3584, 128), gemv_tile(200, 256, 64)) == (32, 64, 0)
    if True:                                                                     # the rules alone: tuned={}
        down = gemv_config(2, 3584, 18944, "int4", 128, 132, tuned={})                     # two rows: the sub-tile rule
        assert (down["BLOCK_N"], down["BLOCK_K"], down["SUB_K"], down["SPLIT_K"]) == (32, 512, 128, 5)
        assert "WORDS" not in down and gemv_config(2, 37888, 3584, "int4", 128, 132, tuned={})["SPLIT_K"] == 1
        one = gemv_config(1, 3584, 18944, "int4", 128, 132, tuned={})                      # one row: the words rule
        assert (one["WORDS"], one["BLOCK_N"], one["BLOCK_K"], one["SPLIT_K"]) == (True, 64, 128, 10)
        assert one["HALF2"] and one["SHIFT"] and not gemv_config(1, 3584, 18944, "int8", None, 132, tuned={}).get("WORDS")
        f16 = gemv_config(1, 3584, 18944, "int8", None, 132, tuned={})                    # INT8, one row: the fp16 pairs rule
        assert (f16["F16"], f16["BLOCK_N"], f16["BLOCK_K"]) == (True, 32, 256)
        assert not gemv_config(2, 3584, 18944, "int8", None, 132, tuned={}).get("F16")     # two rows: no
        assert not gemv_config(1, 3584, 18944 + 128, "int8", None, 132, tuned={}).get("F16")  # 256 does not divide K: no
        assert words_path(1, 3584, 18944, "int4", 128, one)
        assert not gemv_config(1, 3584, 3584, "int4", 96, 132, tuned={}).get("WORDS")      # a group of 96: no words
        assert gemv_config(1, 3584, 3584, "int4", 96, 132, tuned={})["SUB_K"] == 32         # a sub-tile never crosses a group
        assert gemv_config(1, 3584, 3584, "int8", None, 132, {"BLOCK_K": 128}, tuned={})["SUB_K"] == 128
        assert gemm_config(40, 3584, 3584, "int4", 64, 132)["BLOCK_K"] == 64
        gu8, gu32 = gemm_config(8, 37888, 3584, "int4", 128, 132), gemm_config(32, 37888, 3584, "int4", 128, 132)
        assert gu8["PACKED"] and (gu8["BLOCK_M"], gu8["BLOCK_N"], gu8["num_warps"]) == (16, 128, 8)   # TUNED_GEMM
        assert gu32["PACKED"] and (gu32["BLOCK_M"], gu32["BLOCK_N"]) == (32, 64)                       # the rule
        assert gemm_config(33, 37888, 3584, "int4", 128, 132).get("PACKED")        # every row count now
        assert gemm_config(600, 37888, 3584, "int4", 128, 132).get("PACKED")
        nib = gemm_config(8, 37888, 3584, "int4", 128, 132, {"PACKED": False})      # the control: the rule's tiles
        assert not nib["PACKED"] and (nib["BLOCK_N"], nib["num_warps"]) == (64, 4)
        assert not gemm_config(8, 37888, 3584, "int8", None, 132).get("PACKED")
        cand = {"BLOCK_N": 64, "num_warps": 8, "SPLIT_K": 1}                   # an A/B's candidate for one shape
        c = gemv_config(1, 3584, 18944, "int8", None, 132, tuned=cand)
        assert (c["BLOCK_N"], c["num_warps"], c["SPLIT_K"]) == (64, 8, 1)
        assert gemv_config(2, 3584, 18944, "int4", 128, 132, tuned={})["BLOCK_N"] == 32    # other method / shape: the rules
        assert gemv_config(1, 3584, 18944, "int8", None, 132, {"BLOCK_N": 16}, tuned=cand)["BLOCK_N"] == 16   # config wins


def test_kernels_support():
    assert kernels_support("int8", None) and kernels_support("int4", 32) and kernels_support("int4", 128)
    assert not kernels_support("int4", 16)
    with pytest.raises(ValueError, match="group_size % 32"):
        quant_matmul(torch.randn(1, 64), *quantize_int4(torch.randn(8, 64), 16), None, "int4", 16)


# -- QuantLinear ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_quant_linear_paths(method):
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(128, 80, bias=True)
    with torch.no_grad(): lin.bias.normal_(generator=g)
    ql = QuantLinear.from_linear(lin, method, 64, name="layers.0.self_attn.qkv_proj")
    assert (ql.in_features, ql.out_features, ql.method, ql.group_size) == (128, 80, method, 64 if method == "int4" else None)
    x = torch.randn(3, 7, 128, generator=g)
    out = ql(x)
    assert out.shape == (3, 7, 80)
    torch.testing.assert_close(out, F.linear(x, ql.dequantized_weight(), lin.bias), atol=1e-5, rtol=1e-5)
    assert ((out - lin(x)).norm() / lin(x).norm()) < (0.01 if method == "int8" else 0.06)
    if not torch.cuda.is_available():
        assert not ql.use_kernels(x)                    # CPU default: the torch reference
        ql.kernels = True
        assert ql.use_kernels(x)
        torch.testing.assert_close(ql(x), out, atol=1e-4, rtol=1e-4)


def test_quant_linear_errors():
    lin = nn.Linear(96, 8)
    with pytest.raises(ValueError, match="layers.2.mlp.down_proj: group_size 64 does not divide in_features 96"):
        QuantLinear.from_linear(lin, "int4", 64, name="layers.2.mlp.down_proj")
    with pytest.raises(ValueError, match="one of int8, int4"):
        QuantLinear.from_linear(lin, "nf4")


# -- quantize_model ------------------------------------------------------------------------------------------------

def small_model(tie=True, dtype=torch.float32, seed=0):
    cfg = ModelConfig(vocab_size=384, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie)
    torch.manual_seed(seed)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"): p.uniform_(0.5, 1.5)
            else: p.normal_(0.0, 0.03)
    m.rotary.build("cpu", dtype)
    return m.to(dtype).eval().requires_grad_(False)


def logits(model, ids, block_size=16):
    cfg, T = model.config, ids.numel()
    dtype = model.norm.weight.dtype
    nb = -(-T // block_size)
    caches = [(torch.zeros(nb, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype),
               torch.zeros(nb, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype))
              for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(torch.arange(T), prefills=[PrefillChunk(0, T, 0, torch.arange(nb))])
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(T), caches, meta))


IDS = torch.randint(0, 384, (24,), generator=torch.Generator().manual_seed(2))


def _linears(m):
    return [getattr(getattr(l, p.split(".")[0]), p.split(".")[1]) for l in m.layers for p in QUANT_TARGETS]


def test_quantize_model_close_and_smaller():
    full = logits(small_model(), IDS)
    errs, lin_bytes = {}, {"bf16": sum(weight_bytes(l) for l in _linears(small_model(dtype=torch.bfloat16)))}
    for method, G in (("int8", 128), ("int4", 64), ("int4", 32)):
        m = small_model()
        rep = quantize_model(m, method, G)
        assert isinstance(rep, QuantReport) and rep.num_replaced == 8 and not rep.lm_head_quantized
        assert rep.group_size == (G if method == "int4" else None)
        assert all(isinstance(l, QuantLinear) for l in _linears(m))
        assert m.layers[0].self_attn.qkv_proj.bias is not None and m.layers[0].self_attn.o_proj.bias is None
        assert rep.weight_bytes_after == weight_bytes(m) < rep.weight_bytes_before
        assert rep.saved_bytes == rep.weight_bytes_before - rep.weight_bytes_after
        errs[(method, G)] = ((logits(m, IDS) - full).norm() / full.norm()).item()
        lin_bytes[(method, G)] = sum(weight_bytes(l) for l in _linears(m))
    assert errs[("int8", 128)] < 0.03 and errs[("int4", 64)] < 0.3
    assert errs[("int8", 128)] < errs[("int4", 32)]
    assert lin_bytes[("int4", 64)] < lin_bytes[("int4", 32)] < lin_bytes[("int8", 128)] < lin_bytes["bf16"]


def test_quantize_model_bf16_keeps_dtypes():
    m = small_model(dtype=torch.bfloat16)
    quantize_model(m, "int4", 64)
    qkv = m.layers[1].self_attn.qkv_proj
    assert qkv.bias.dtype == torch.bfloat16 and qkv.scales.dtype == torch.float32 and qkv.qweight.dtype == torch.uint8
    assert logits(m, IDS).shape == (24, 384)


@pytest.mark.parametrize("tie", [True, False])
def test_quantize_lm_head(tie):
    m = small_model(tie=tie)
    full = logits(m, IDS)
    before = weight_bytes(m)
    rep = quantize_model(m, "int8", quantize_lm_head=True)
    assert rep.num_replaced == 9 and rep.lm_head_quantized
    if tie: assert isinstance(m.embed_tokens, QuantEmbedding) and m.embed_tokens.table is m.quant_lm_head
    else: assert m.lm_head is m.quant_lm_head and isinstance(m.embed_tokens, nn.Embedding)
    assert rep.weight_bytes_after == weight_bytes(m) and rep.weight_bytes_before == before
    assert ((logits(m, IDS) - full).norm() / full.norm()) < 0.05


def test_quantize_model_bad_inputs_change_nothing():
    m = small_model()
    for args, msg in (((m, "int2"), "unknown quantization method 'int2': one of int8, int4"),
                      ((m, "int4", 0), "even integer >= 2"), ((m, "int4", 7), "even integer >= 2"),
                      ((m, "int4", 512), "layers.0.self_attn.qkv_proj: group_size 512 does not divide in_features 256"),
                      ((m, "int4", 256), "layers.0.mlp.down_proj: group_size 256 does not divide in_features 192")):
        with pytest.raises(ValueError, match=msg): quantize_model(*args)
    assert all(isinstance(l, nn.Linear) for l in _linears(m))
    quantize_model(m, "int8")
    with pytest.raises(ValueError, match="already quantized"): quantize_model(m, "int4", 64)


def test_quantize_on_meta_counts_exact_bytes():
    "Quantizing the 0.5B shape on the meta device: the byte count equals the formula (no memory used)."
    from nanoserve.bench import SHAPES
    cfg = ModelConfig(**SHAPES["0.5B"], dtype="bfloat16")
    with torch.device("meta"): m = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    before = weight_bytes(m)
    rep = quantize_model(m, "int4", 128)
    h, inter, qkv = 896, 4864, 1152
    mats = [(qkv, h), (h, h), (2 * inter, h), (h, inter)]
    saved = 24 * sum(2 * N * K - quantized_linear_bytes(N, K, "int4", 128) for N, K in mats)
    assert rep.weight_bytes_before == before and rep.saved_bytes == saved
    assert 490 * 2**20 < saved < 600 * 2**20                                    # the linear layers alone
    with torch.device("meta"): m = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    assert quantize_model(m, "int4", 128, quantize_lm_head=True).saved_bytes >= 600 * 2**20


def test_import_without_interpret_on_cpu():
    "The package imports on a CPU machine with TRITON_INTERPRET unset (no driver queries at import time)."
    import subprocess, sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", "import nanoserve.quant as q; print(q.METHODS)"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


HALF2_COMPILE = """
import nanoserve.quant as Q
for cfg in ({}, {"SHIFT": True}):
    cfg = {"SHIFT": False, **cfg, "BLOCK_N": 64, "num_warps": 4}   # over the table: the lanes by cvt, then by a shift
    cc = Q.compile_one_row(3584, 3584, "int4", 128, config=cfg)
    ptx = cc.asm["ptx"]
    print(len(cc.asm["cubin"]), ptx.count("lop3.b32"), ptx.count("fma.rn.bf16x2"), ptx.count("cvt.f32.bf16"),
          ptx.count("mma.sync"))
"""


def test_half2_ptx_compiles_for_hopper():
    """The packed-pairs path's inline PTX in its four forms (shipped; zero point in the pairs; lanes by shift; both)
    and the tensor-core words path, compiled for sm_90 on the CPU (Triton's ptxas) with what `quant_gemv` would
    launch: they run on a GPU only."""
    rows = [tuple(map(int, line.split())) for line in compiled_run(HALF2_COMPILE).split("\n") if line.strip()]
    # 64 channels x 16 words over 128 threads: 8 words a thread, each 4 lop3 and 8 packed multiply-adds, and two
    # cvt per word unless the lanes are taken by a shift and a mask; the tensor cores: 4 lop3 and 4 packed adds a
    # word, and the mma instructions
    assert [row[1:4] for row in rows] == [(32, 64, 16), (32, 64, 0)], rows
    assert all(row[0] > 0 for row in rows) and [row[4] > 0 for row in rows] == [False] * 2


INT8_COMPILE = """
import nanoserve.quant as Q
cc = Q.compile_one_row(37888, 3584, "int8", None, config={"F16": True, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4})
ptx = cc.asm["ptx"]
print(len(cc.asm["cubin"]), ptx.count("prmt.b32"), ptx.count("fma.rn.f16x2"), ptx.count("cvt.rn.f16x2.f32"))
"""


def test_int8_pairs_ptx_compiles_for_hopper():
    "INT8 at one row in fp16 pairs (`F16`), compiled for sm_90 on the CPU as `quant_gemv` would launch it."
    cubin, prmt, fma, cvt = map(int, compiled_run(INT8_COMPILE).split())
    # 64 channels x 16 word pairs over 128 threads: 8 calls a thread, each 4 byte permutes and 4 multiply-adds;
    # the activation pairs are converted once per pair a thread holds
    assert cubin > 0 and (prmt, fma) == (32, 32) and 0 < cvt <= 16


MADE_COMPILE = """
import nanoserve.quant as Q
for method, K, g in (("int8", 3584, None), ("int4", 3584, 128), ("int8", 18944, None), ("int4", 18944, 128)):
    made = ((1, False), (1, True), (3, False)) if K == 3584 else ((2, False),)
    for IN, res in made:
        extra = {"IN": IN, "HAS_RESIDUAL": res, "ROW_W": 2048 if IN == 1 else 1}
        ptx = Q.compile_one_row(3584, K, method, g, extra=extra).asm["ptx"]
        print(method, IN, int(res), ptx.count("griddepcontrol.wait"), ptx.count("sqrt"), ptx.count("ex2.approx"),
              ptx.count("st.global"))
"""


def test_made_inputs_compile_for_hopper():
    """The one-row INT8 (fp16 pairs) and INT4 (half2) GEMVs that make their own input, compiled for sm_90 on the CPU
    at the 7B's shapes as `quant_gemv` would launch them: the norm's variants take a square root (and, with a residual,
    store the new one), SiLU x up's an exponential; each waits once on the kernel before."""
    rows = [line.split() for line in compiled_run(MADE_COMPILE).splitlines() if line.strip()]
    got = {(m, int(i), int(r)): tuple(map(int, rest)) for m, i, r, *rest in rows}
    assert set(got) == ({(m, 1, r) for m in ("int8", "int4") for r in (0, 1)}
                        | {(m, made, 0) for m in ("int8", "int4") for made in (2, 3)}), got
    for (m, made, res), (wait, sqrt, ex2, stores) in got.items():
        assert wait == 1 and (sqrt > 0) == (made == 1) and (ex2 > 0) == (made == 2), (m, made, got)
    for m in ("int8", "int4"):
        assert got[m, 1, 1][3] > got[m, 1, 0][3]                         # the new residual's store


def test_gemv_launch_matches_the_rules():
    "What `compile_one_row` compiles is what `quant_gemv` launches: the GPU decisions, whatever the interpreter."
    from nanoserve.quant import gemv_launch, PAIRS_ASM, PAIRS_ASM_SHIFT
    gpu = gemv_launch(1, 3584, 3584, "int4", 128, torch.bfloat16, 132, interpret=False)    # the tuned table
    assert gpu["constexprs"]["HALF2"] and gpu["constexprs"]["ASM"] == PAIRS_ASM_SHIFT
    assert not gpu["constexprs"]["EMULATE"] and gpu["maxnreg"] == 128
    plain = {"ZPAIR": False, "SHIFT": False}
    shipped = gemv_launch(1, 3584, 3584, "int4", 128, torch.bfloat16, 132, plain, interpret=False)
    assert shipped["constexprs"]["HALF2"] and shipped["constexprs"]["ASM"] == PAIRS_ASM
    cpu = gemv_launch(1, 3584, 3584, "int4", 128, torch.bfloat16, 132, plain, interpret=True)
    assert cpu["constexprs"]["HALF2"] and cpu["constexprs"]["EMULATE"]             # the interpreter emulates the PTX
    z = gemv_launch(1, 3584, 3584, "int4", 128, torch.bfloat16, 132, {"ZPAIR": True, "SHIFT": True}, interpret=True)
    assert z["constexprs"]["HALF2"] and z["constexprs"]["EMULATE"] and z["constexprs"]["ASM"] == PAIRS_ASM_SHIFT
    f = gemv_launch(1, 3584, 3584, "int4", 128, torch.float32, 132, {"ZPAIR": True}, interpret=False)
    assert not f["constexprs"]["HALF2"]               # fp32 activations: no pairs
    assert gpu["grid"] == (3584 // 64, 7) and gpu["pdl"] is False      # the table: 64 channels, 7 splits of 28 tiles
    assert gpu["constexprs"]["TILE"] == 0 and gemv_launch(1, 3584, 3584, "int4", 128, torch.bfloat16, 132,
                                                          interpret=False, tile=64)["constexprs"]["TILE"] == 64
    assert gemv_launch(1, 3584, 3584, "int4", 128, torch.bfloat16, 132, pdl=True, interpret=False)["pdl"]
    i8 = lambda M, dtype, cfg: gemv_launch(M, 3584, 3584, "int8", None, dtype, 132, cfg, interpret=False)["constexprs"]
    assert i8(1, torch.bfloat16, {})["F16"] and not i8(1, torch.bfloat16, {"F16": False})["F16"]     # the table: F16
    assert not i8(2, torch.bfloat16, {"F16": True})["F16"] and not i8(1, torch.float16, {"F16": True})["F16"]
    assert not i8(1, torch.bfloat16, {"F16": True, "BLOCK_K": 512 + 8})["F16"]     # the tile must divide K
    cap = lambda interpret: gemv_launch(1, 3584, 3584, "int4", 128, torch.bfloat16, 132, {"MAXNREG": 80},
                                        interpret=interpret)["maxnreg"]
    assert cap(False) == 80 and cap(True) is None and shipped["maxnreg"] == 128     # a register cap: GPU only


# -- through the engine ---------------------------------------------------------------------------------------
def test_engine_quantized_equals_dequantized_weights():
    "The engine with int8/int4 weights generates what the fp32 model with the dequantized weights generates."
    from nanoserve.engine import LLM, SamplingParams
    from nanoserve.quant import QuantLinear
    from nanoserve.tokenizer import default_model
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:"]
    sp = SamplingParams(max_tokens=16, temperature=0)
    for method, group in (("int8", 128), ("int4", 16)):
        q = LLM(default_model(), dtype="float32", quantization=method, quant_group_size=group, max_num_seqs=4)
        assert q.quant_report.method == method and q.quant_report.weight_bytes_after < q.quant_report.weight_bytes_before
        assert f"{method} weights" in repr(q)
        ref = LLM(default_model(), dtype="float32", max_num_seqs=4)
        qmods = dict(q.model.named_modules())
        n = 0
        for name, mod in ref.model.named_modules():
            if isinstance(qmods.get(name), QuantLinear):
                mod.weight.data.copy_(qmods[name].dequantized_weight(torch.float32)); n += 1
        assert n == 4 * q.config.num_hidden_layers
        assert q.quant_report.lm_head_method == "int8"                # the default head (tied: the embedding too)
        ref.model.embed_tokens.weight.data.copy_(q.model.quant_lm_head.dequantized_weight(torch.float32))
        assert [o.token_ids for o in q.generate(prompts, sp)] == [o.token_ids for o in ref.generate(prompts, sp)]


def test_engine_quantization_errors():
    from nanoserve.engine import LLM
    from nanoserve.tokenizer import default_model
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM(default_model(), quantization="int3")
    with pytest.raises(ValueError, match="down_proj: group_size 128 does not divide in_features 688"):
        LLM(default_model(), quantization="int4")
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM(default_model(), quantization="int8", tensor_parallel_size=2)


SASS_COUNT = """
import json, sys
sys.path.insert(0, "kernels")
import quant_sass_cpu as S
rows = [S.count(37888, 3584, "int8"), S.count(3584, 3584, "int4 zero point in pairs"),
        S.count(3584, 3584, "int4 pairs (shipped)"), S.count(37888, 3584, "int8 tensor-core GEMM (FEW_ROWS_GEMM)")]
print(json.dumps([rows, S.ncu_counts(S.Path("figures/data/quant_ncu_h200.csv"))["(2368, 1, 1)"]]))
"""


MAXNREG_COMPILE = """
import json, sys
sys.path.insert(0, "kernels")
import quant_sass_cpu as S
import nanoserve.quant as Q
cfg = {"ZPAIR": True, "SHIFT": True, "BLOCK_N": 256, "num_warps": 4, "SPLIT_K": 8, "MAXNREG": None}
regs = [S.disassemble(Q.compile_one_row(37888, 3584, "int4", 128, config={**cfg, "MAXNREG": cap}).asm["cubin"])[1]["REG"]
        for cap in (None, 128)]
print(json.dumps(regs))
"""


TABLE_LOADS = """
import json, sys
sys.path.insert(0, "kernels")
import quant_sass_cpu as S
import nanoserve.quant as Q
out = {}
for m, N, K in Q.quant_tables()["tuned_gemv"]:
    cc = Q.compile_one_row(N, K, m, 128 if m == "int4" else None)
    out[f"{m} {N}x{K}"] = S.global_loads(S.disassemble(cc.asm["cubin"])[0])
print(json.dumps(out))
"""


def test_table_kernels_load_weights_16_bytes_at_a_time():
    """Every kernel of the tuned one-row table loads its weight tile 16 bytes an instruction (`LDG.E.128`), compiled
    for sm_90 on the CPU. The fp16 pairs' first version loaded 8 bytes at a time and ran L1-bound, twice as slow."""
    import json
    kernels = json.loads(compiled_run(TABLE_LOADS, 900).strip().splitlines()[-1])
    assert len(kernels) == len(TUNED_GEMV)
    for name, loads in kernels.items():
        widths = {op for code, ops in loads.items() if code.startswith(("w2 = tl.load(wp", "words = tl.load(wp"))
                  for op in ops}
        assert widths == {"LDG.E.128"}, (name, loads)


def test_register_cap_reaches_ptxas():
    "A config's `MAXNREG` reaches ptxas: the 256-channel INT4 gate/up tile takes over 128 registers uncapped."
    import json
    free, capped = json.loads(compiled_run(MAXNREG_COMPILE).strip().splitlines()[-1])
    assert free > 128 >= capped, (free, capped)


def test_static_instruction_counts_agree_with_nsight():
    """`kernels/quant_sass_cpu.py` on this CPU (Triton's ptxas, nvdisasm, cuobjdump): the INT8 gate/up GEMV is the
    kernel Nsight Compute profiled on the H200 (figures/data/quant_ncu_h200.csv), so its static estimate must come
    within 5% of the instructions Nsight counted, with the same registers; and the zero point inside the INT4 pairs
    must count fewer instructions than the shipped pairs."""
    import json
    (int8, zpair, shipped, gemm), ncu = json.loads(compiled_run(SASS_COUNT).strip().splitlines()[-1])
    assert abs(int8["estimated_warp_instructions"] / ncu["Executed Instructions"] - 1) < 0.05
    assert int8["registers"] == ncu["Registers Per Thread"] and int8["config"]["kernel"] == "quant_gemv_kernel"
    assert zpair["estimated_instructions_per_weight"] < shipped["estimated_instructions_per_weight"]
    assert gemm["config"]["kernel"] == "quant_gemm_kernel" and gemm["loop_opcodes"].get("HMMA", 0) > 0


TABLE_PTX = """
import hashlib, json, torch
import nanoserve.quant as Q
def norm(ptx):
    out, skip = [], False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and ".debug" in s: skip = True
        if skip:
            if s == "}": skip = False
            continue
        if s.startswith((".loc", ".file", "//", "$L__tmp", ".param")) or not s: continue   # (a kernel's parameter
        # list: the ones a path does not read, such as a made input's, declared and never loaded)
        out.append(s)
    return "\\n".join(out)
res = {}
for key in json.loads('@@KEYS@@'):
    m, shape, dt, *g = key.split()
    N, K = map(int, shape.split("x"))
    cc = Q.compile_one_row(N, K, m, 128 if m == "int4" else None, dtype=getattr(torch, dt), gemm=bool(g))
    res[key] = hashlib.sha256(norm(cc.asm["ptx"]).encode()).hexdigest()[:16]
print(json.dumps(res))
"""
# The PTX (debug lines, labels and the parameter list aside) of every kernel the shipped tables and rules select at
# one row, recorded before the GEMV kernel was split into one-job helpers (and again, with the same values from that
# tree and this one, when the made-input parameters joined the list): the H200 runs exactly these.
TABLE_PTX_HASHES = {
    "int8 896x896 bfloat16": "b8e6fe61131ec466",
    "int8 896x4864 bfloat16": "8e9a0865a0c587a9",
    "int8 1152x896 bfloat16": "b8e6fe61131ec466",
    "int8 1536x1536 bfloat16": "51bf6e18e8782b97",
    "int8 1536x8960 bfloat16": "c85728799f248fc3",
    "int8 1536x8960 float16": "e2b69bc38e8a5565",
    "int8 2048x1536 bfloat16": "51bf6e18e8782b97",
    "int8 3584x3584 bfloat16": "e3b74f04ab9700e1",
    "int8 3584x3584 bfloat16 gemm": "f342f499342796fb",
    "int8 3584x3584 float16": "61dc12a8ac46fd25",
    "int8 3584x3584 float16 gemm": "b057ded586ee7951",
    "int8 3584x18944 bfloat16": "a11449e88ea3bdc3",
    "int8 3584x18944 bfloat16 gemm": "f342f499342796fb",
    "int8 4608x3584 bfloat16": "dba2427cd5a49783",
    "int8 9728x896 bfloat16": "6a830ce3a92b60e8",
    "int8 17920x1536 bfloat16": "7a88bad88486981a",
    "int8 37888x3584 bfloat16": "7a88bad88486981a",
    "int8 37888x3584 bfloat16 gemm": "b2e744ffeca83a1a",
    "int8 152064x3584 bfloat16": "7a88bad88486981a",
    "int4 896x896 bfloat16": "9de175faa4f20a7f",
    "int4 896x4864 bfloat16": "96134980ef1fc4ca",
    "int4 1152x896 bfloat16": "73a01b833d4b371a",
    "int4 1536x1536 bfloat16": "2ddb2c1e2827aaf2",
    "int4 1536x8960 bfloat16": "2944f53057ca6826",
    "int4 1536x8960 float16": "7403e9df9e79d5a4",
    "int4 2048x1536 bfloat16": "2ddb2c1e2827aaf2",
    "int4 3584x3584 bfloat16": "1cb26a5b02f3e3eb",
    "int4 3584x3584 bfloat16 gemm": "b7bc68e20883610f",
    "int4 3584x3584 float16": "f0db5158361dd8f2",
    "int4 3584x3584 float16 gemm": "f035b0b7dcf0afed",
    "int4 3584x18944 bfloat16": "600f044340e59e60",
    "int4 4608x3584 bfloat16": "96134980ef1fc4ca",
    "int4 9728x896 bfloat16": "642fe2f17f10fd64",
    "int4 17920x1536 bfloat16": "2944f53057ca6826",
    "int4 37888x3584 bfloat16": "600f044340e59e60",
    "int4 37888x3584 bfloat16 gemm": "c017d5d188f3ed00",
    "int4 152064x3584 bfloat16": "c345acb503342c10",
}


def test_table_selected_kernels_are_unchanged():
    """Every kernel the tuning tables and rules select at one row (7B, 1.5B and 0.5B shapes, bf16 and fp16, GEMV
    and the few-rows GEMM), compiled for sm_90 on the CPU, has the PTX it had when the tables were measured."""
    import json
    script = TABLE_PTX.replace("@@KEYS@@", json.dumps(sorted(TABLE_PTX_HASHES)))
    got = json.loads(compiled_run(script, 900).strip().splitlines()[-1])
    assert got == TABLE_PTX_HASHES


def test_the_engines_lm_head_default_and_choices():
    """`LLM(quantization=...)` quantizes the LM head by the package's default (`DEFAULT_LM_HEAD`: INT8 for INT8 and
    INT4 models, none for fp8), or as asked: the body's format, another, or "none" (a command line's word for False)."""
    from nanoserve.engine import LLM
    from nanoserve.quant import DEFAULT_LM_HEAD
    from nanoserve.tokenizer import default_model
    assert DEFAULT_LM_HEAD == {"int8": "int8", "int4": "int8", "fp8": None}
    head = lambda **kw: LLM(default_model(), dtype="float32", num_kv_blocks=16, **kw).quant_report.lm_head_method
    assert head(quantization="int4", quant_group_size=16) == "int8"
    assert head(quantization="int4", quant_group_size=16, quantize_lm_head=True) == "int4"
    assert head(quantization="int8", quantize_lm_head="none") is None
    with pytest.raises(ValueError, match="needs a quantization method"):
        LLM(default_model(), quantize_lm_head="int8")

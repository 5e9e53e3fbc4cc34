"""fp8 W8A8 (the quantization chapter): e4m3 weights with a scale a channel, activations rounded to e4m3 with a scale
a row as the step runs, products by `torch._scaled_mm`. On the CPU: the quantizers against their definitions, the
Triton row quantizer through the interpreter (on inputs whose e4m3 values are exact, where the interpreter's own
rounding cannot differ), the product against the reference, the layers, the model and the engine."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import helpers
from helpers import build_tokenizer_source, make_checkpoint, random_prompt
from nanoserve.engine import LLM, SamplingParams
from nanoserve.model import AttentionMetadata, PrefillChunk, load_model
from nanoserve.quant import (FP8_MAX, QuantConfig, QuantEmbedding, QuantLinear, dequantize_fp8, fp8_matmul,
                             fp8_matmul_ref, quantize_fp8, quantize_model, quantize_rows_fp8, quantize_rows_fp8_ref,
                             quantized_linear_bytes, weight_bytes)

FP8 = torch.float8_e4m3fn


def test_weights_round_within_a_sixteenth_of_themselves():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 64, generator=g) * torch.tensor([1e-3, 1.0, 50.0, 0.0, 3.0])[:, None]
    q, s = quantize_fp8(w)
    assert q.dtype == FP8 and s.shape == (5,)
    back = dequantize_fp8(q, s)
    live = [0, 1, 2, 4]
    assert ((back - w).abs()[live] <= w.abs()[live] / 16 + 1e-30).all()
    assert torch.equal(back[3], torch.zeros(64)) and s[3] == 1.0
    assert torch.equal(q.float().abs().amax(1)[live], torch.full((4,), FP8_MAX))
    with pytest.raises(ValueError, match="2-D weight"): quantize_fp8(torch.ones(4))


def on_grid_rows(T, K, seed=0, dtype=torch.float32):
    "Rows whose values over their scale are e4m3 numbers with the peak at 448: every rounding gives the same bytes."
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(T, K, generator=g).to(FP8).float()
    v[:, K // 3] = FP8_MAX * torch.where(torch.arange(T) % 2 == 0, 1.0, -1.0)
    return (v * torch.tensor([2.0 ** (i % 9 - 6) for i in range(T)])[:, None]).to(dtype)


@pytest.mark.parametrize("K", [16, 300, 2048, 5000, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_row_kernel_writes_the_references_bytes(K, dtype):
    x = on_grid_rows(6, K, seed=K, dtype=dtype)
    x[2] = 0
    (q, s), (q_ref, s_ref) = quantize_rows_fp8(x), quantize_rows_fp8_ref(x)
    assert torch.equal(s, s_ref) and s.shape == (6, 1) and s[2] == 1.0
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_the_row_kernel_follows_the_row_stride_and_takes_no_rows():
    wide = torch.randn(4, 100) * 5
    x = wide[:, :64]                                            # rows 100 apart
    assert torch.equal(quantize_rows_fp8(x)[1], quantize_rows_fp8_ref(x)[1])
    grid = on_grid_rows(4, 64)
    wide[:, :64] = grid
    assert torch.equal(quantize_rows_fp8(wide[:, :64])[0].view(torch.uint8), quantize_rows_fp8_ref(grid)[0].view(torch.uint8))
    q, s = quantize_rows_fp8(x[:0])
    assert q.shape == (0, 64) and s.shape == (0, 1)
    with pytest.raises(ValueError, match="contiguous along K"): quantize_rows_fp8(x.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_the_references(dtype):
    g = torch.Generator().manual_seed(1)
    q, s = quantize_fp8(torch.randn(48, 160, generator=g) * 0.1)
    x, bias = torch.randn(9, 160, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
    for b in (None, bias):
        got, want = fp8_matmul(x, q, s, b), fp8_matmul_ref(x, q, s, b)
        assert got.dtype == dtype and got.shape == (9, 48)
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < (1e-6 if dtype == torch.float32 else 5e-3), rel       # bf16: rounded once more, before the bias
    exact = x.float() @ (q.float() * s[:, None]).t()
    xq, xs = quantize_rows_fp8_ref(x)
    assert torch.allclose(fp8_matmul_ref(x.float(), q, s, None), (xq.float() * xs) @ (q.float() * s[:, None]).t())
    assert not torch.allclose(fp8_matmul_ref(x.float(), q, s, None), exact, rtol=1e-4)   # the activations do round
    assert fp8_matmul(x[:0], q, s, None).shape == (0, 48)


def small_model(tie=True, **kw):
    return helpers.small_model(tie_word_embeddings=tie, **kw)


def logits(m, ids):
    cfg, T = m.config, ids.numel()
    nb = -(-T // 8)
    caches = [tuple(torch.zeros(nb, 8, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2))
              for _ in range(cfg.num_hidden_layers)]
    with torch.no_grad():
        h = m(ids, torch.arange(T), caches, AttentionMetadata(torch.arange(T), prefills=[PrefillChunk(0, T, 0, torch.arange(nb))]))
        return m.compute_logits(h)


@pytest.mark.parametrize("tie", [True, False])
def test_quantize_model_fp8_with_and_without_the_head(tie):
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(2))
    full = logits(small_model(tie), ids)
    def error(method, group_size=128, head=False):
        m = small_model(tie)
        quantize_model(m, method, group_size, quantize_lm_head=head)
        return ((logits(m, ids) - full).norm() / full.norm()).item()
    for head in (False, True):                                  # e4m3's 3 mantissa bits: between INT8 and INT4
        assert error("int8", head=head) < error("fp8", head=head) < error("int4", 32, head=head)
    for head in (False, True):
        m = small_model(tie)
        rep = quantize_model(m, "fp8", quantize_lm_head=head)
        assert rep.method == "fp8" and rep.group_size is None and rep.num_replaced == 8 + head
        assert rep.weight_bytes_after == weight_bytes(m) < rep.weight_bytes_before
        layer = m.layers[0].self_attn.qkv_proj
        assert isinstance(layer, QuantLinear) and layer.qweight.dtype == FP8
        assert weight_bytes(layer) == quantized_linear_bytes(layer.out_features, layer.in_features, "fp8") + 4 * layer.out_features
        if head and tie: assert isinstance(m.embed_tokens, QuantEmbedding) and m.embed_tokens.table is m.quant_lm_head
        got = logits(m, ids)
        layer.kernels = True                                    # `torch._scaled_mm` on the CPU: the same logits
        torch.testing.assert_close(logits(m, ids), got, rtol=1e-4, atol=1e-4)


def test_fp8_is_refused_where_scaled_mm_cannot_run_and_nothing_changes():
    m = small_model(intermediate_size=100)
    with pytest.raises(ValueError, match=r"layers.0.mlp.gate_up_proj: fp8 needs in and out features divisible by 16, got 200 x 64"):
        quantize_model(m, "fp8")
    assert all(type(l.self_attn.qkv_proj) is nn.Linear for l in m.layers)
    with pytest.raises(ValueError, match="lm_head: fp8 needs"):
        quantize_model(small_model(vocab_size=300), "fp8", quantize_lm_head=True)
    assert QuantConfig("fp8").method == "fp8"
    with pytest.raises(ValueError, match="one of int8, int4, fp8"): QuantConfig("fp4")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("random-qwen2-16")
    make_checkpoint(folder, seed=3, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                    tokenizer_from=build_tokenizer_source(tmp_path_factory.mktemp("tokenizer")))
    return folder


@torch.no_grad()
def recomputed_greedy(model, ids: list[int], n: int) -> list[int]:
    "Greedy tokens, each from one prefill of the whole sequence so far (nothing reused): the oracle."
    out = list(ids)
    for _ in range(n): out.append(int(logits(model, torch.tensor(out))[-1].argmax()))
    return out[len(ids):]


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("setup", [{}, dict(max_num_batched_tokens=8, max_num_seqs=4), dict(block_size=4, num_kv_blocks=20)])
def test_an_fp8_engine_gives_the_recomputed_tokens(ckpt, setup):
    "A token's activations are quantized by their own row, so chunks, batches and preemption change nothing."
    model = load_model(ckpt, dtype=torch.float32)
    quantize_model(model, "fp8")
    prompts = [random_prompt(n, model.config.vocab_size, seed=n) for n in (5, 23, 37)]
    llm = LLM(ckpt, dtype="float32", device="cpu", quantization="fp8", **setup)
    assert llm.quant_report.method == "fp8" and "fp8 weights" in repr(llm)
    outs = llm.generate(prompts, GREEDY)
    if "num_kv_blocks" in setup: assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [recomputed_greedy(model, p, 10) for p in prompts]


def test_the_command_lines_take_fp8():
    from nanoserve import bench, cli, server
    assert bench.build_parser().parse_args(["--quantization", "fp8"]).quantization == "fp8"
    assert server.build_parser().parse_args(["--quantization", "fp8"]).quantization == "fp8"
    assert cli.build_parser().parse_args(["generate", "--quantization", "fp8", "hi"]).quantization == "fp8"
    with pytest.raises(SystemExit): bench.build_parser().parse_args(["--quantization", "fp4"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [True, False])
def test_the_fused_norm_writes_the_two_kernels_bytes(dtype, residual):
    from nanoserve.fused import add_rmsnorm
    from nanoserve.quant import add_rmsnorm_fp8
    g = torch.Generator().manual_seed(5)
    x, r, w = (torch.randn(7, 320, generator=g) * 3).to(dtype), torch.randn(7, 320, generator=g).to(dtype), \
        (torch.rand(320, generator=g) + 0.5).to(dtype)
    (q, s), res = add_rmsnorm_fp8(x, r if residual else None, w, 1e-5)
    unfused = add_rmsnorm(x, r if residual else None, w, 1e-5)
    normed, res_u = unfused if residual else (unfused, x)
    q_u, s_u = quantize_rows_fp8(normed)
    assert torch.equal(s, s_u) and torch.equal(q.view(torch.uint8), q_u.view(torch.uint8)) and torch.equal(res, res_u)


@pytest.mark.parametrize("inter", [96, 2048, 4500])
def test_the_fused_activation_writes_the_two_kernels_bytes(inter):
    from nanoserve.fused import silu_mul
    from nanoserve.quant import silu_mul_fp8
    gu = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    (q, s), (q_u, s_u) = silu_mul_fp8(gu), quantize_rows_fp8(silu_mul(gu))
    assert torch.equal(s, s_u) and torch.equal(q.view(torch.uint8), q_u.view(torch.uint8))
    assert silu_mul_fp8(gu[:0])[0].shape == (0, inter)


def test_the_decoder_hands_fp8_layers_their_inputs_when_it_runs_the_kernels(monkeypatch):
    """With the fused kernels in the table, each fp8 QKV and gate/up layer gets the norm's input and each down layer the
    gate/up output: the fused kernels run, and with torch's e4m3 rounding in their place (the interpreter rounds
    some values its own way) the logits are the torch path's."""
    import nanoserve.quant as Q
    from nanoserve.fused import add_rmsnorm, silu_mul
    from nanoserve.model import ModelKernels
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(6))
    m = small_model()
    quantize_model(m, "fp8")
    want = logits(m, ids)                                      # the torch path: norms and activations in torch
    for layer in m.modules():
        if isinstance(layer, QuantLinear): layer.kernels = True
    m.set_kernels(ModelKernels(add_rmsnorm=add_rmsnorm, silu_mul=silu_mul))
    calls = []
    real_norm, real_act = Q.add_rmsnorm_fp8, Q.silu_mul_fp8
    monkeypatch.setattr(Q, "add_rmsnorm_fp8", lambda *a: (calls.append("norm"), real_norm(*a))[1])
    monkeypatch.setattr(Q, "silu_mul_fp8", lambda *a: (calls.append("act"), real_act(*a))[1])
    assert torch.isfinite(logits(m, ids)).all()
    assert calls == ["norm", "norm", "act"] * 2                # two layers: QKV and gate/up, then down

    def norm_then_round(x, residual, weight, eps):
        out = add_rmsnorm(x, residual, weight, eps)
        normed, new_residual = out if residual is not None else (out, x)
        return quantize_rows_fp8_ref(normed), new_residual
    monkeypatch.setattr(Q, "add_rmsnorm_fp8", norm_then_round)
    monkeypatch.setattr(Q, "silu_mul_fp8", lambda gu: quantize_rows_fp8_ref(silu_mul(gu)))
    got = logits(m, ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


FP8_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import nanoserve.quant as Q
def build(kernel, sig, consts):
    src = ASTSource(fn=kernel, signature={n: sig.get(n, "constexpr") for n in kernel.arg_names},
                    constexprs={(i,): consts[n] for i, n in enumerate(kernel.arg_names) if n in consts})
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return cc.asm["ptx"]
rows = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "K": "i32", "stride_x": "i32", "stride_out": "i32"}
for one in (True, False):
    ptx = build(Q.quantize_rows_fp8_kernel, rows, {"BLOCK": 4096 if one else 2048, "ONE_PASS": one})
    print("rows", one, ptx.count("cvt.rn.satfinite.e4m3x2.f32"), ptx.count("div.rn.f32"))
norm = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
        "new_residual_ptr": "*bf16", "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_nr": "i32"}
ptx = build(Q.add_rmsnorm_fp8_kernel, norm, {"HIDDEN": 3584, "BLOCK": 4096, "HAS_RESIDUAL": True})
print("norm", ptx.count("cvt.rn.satfinite.e4m3x2.f32"), ptx.count("div.rn.f32"))
import nanoserve.fused as F
plain = dict(norm, out_ptr="*bf16")                  # the bf16 kernel shares its row with the fp8 one
ptx = build(F.add_rmsnorm_kernel, plain, {"HIDDEN": 3584, "BLOCK": 4096, "HAS_RESIDUAL": True, "PDL": True})
print("bf16norm", ptx.count("st.global"), ptx.count("griddepcontrol.wait"))
act = {"gate_up_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "stride_in": "i32", "stride_out": "i32", "INTER": "i32"}
ptx = build(Q.silu_mul_fp8_kernel, act, {"BLOCK": 2048})
print("act", ptx.count("cvt.rn.satfinite.e4m3x2.f32"), ptx.count("div.rn.f32"))
import nanoserve.fused as F
one = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
       "counter_ptr": "*i32", "res_ptr": "*fp8e4nv", "new_res_ptr": "*fp8e4nv", "norm_w_ptr": "*fp8e4nv",
       "scale_ptr": "*fp32", "x_scale_ptr": "*fp32", "N": "i32", "K": "i32", "tiles_per_split": "i32",
       "stride_wn": "i32", "eps": "fp32"}
ptx = build(F.gemv_kernel, one, {"HAS_BIAS": False, "ACT": False, "BLOCK_N": 16, "BLOCK_K": 1024, "SPLIT": True,
                                 "EVEN": True, "NORM": False, "HAS_RESIDUAL": False, "ROW": 1, "PDL": True, "HAS_SCALE": True})
print("gemv", ptx.count("cvt.rn.f16x2.e4m3x2"), ptx.count("griddepcontrol.wait"))
"""


def test_the_fp8_kernels_compile_for_hopper():
    """The row quantizer (one pass and two), the fused norm and the fused activation, compiled for sm_90 on the CPU
    in bf16 as a GPU launches them (the interpreter accepts Python that Triton's compiler does not): each rounds to
    e4m3 with the hardware's saturating conversion and divides by IEEE rules; and the one-row GEMV over e4m3 weights
    and input, which widens them in pairs."""
    from helpers import compiled_run
    out = {tuple(line.split()[:-2]): tuple(map(int, line.split()[-2:])) for line in compiled_run(FP8_COMPILE).splitlines()}
    assert set(out) == {("rows", "True"), ("rows", "False"), ("norm",), ("act",), ("gemv",), ("bf16norm",)}, out
    assert all(cvt > 0 and div > 0 for cvt, div in out.values()), out      # gemv: e4m3 widened in pairs, one wait


def test_one_row_takes_the_gemv_and_computes_the_same_products(monkeypatch):
    "At one row an fp8 layer's product is the one-row GEMV over e4m3 weights and input: the reference's values."
    import nanoserve.quant as Q
    from nanoserve.model import RMSNorm
    g = torch.Generator().manual_seed(9)
    layer = QuantLinear.from_linear(nn.Linear(256, 96, bias=True), "fp8")
    layer.kernels = True
    calls = []
    real = Q.gemv
    monkeypatch.setattr(Q, "gemv", lambda *a, **k: (calls.append(k["scales"] is layer.scales), real(*a, **k))[1])
    x = torch.randn(1, 256, generator=g)
    torch.testing.assert_close(layer(x), fp8_matmul_ref(x, layer.qweight, layer.scales, layer.bias), rtol=1e-5, atol=1e-5)
    from nanoserve.fused import add_rmsnorm
    norm = RMSNorm(256)
    (out, res), (normed, want_res) = layer.norm_forward(norm, x, x * 0.5), add_rmsnorm(x, x * 0.5, norm.weight, norm.eps)
    want = layer.product(*quantize_rows_fp8(normed), torch.float32)         # the same (interpreter's) e4m3 rounding
    assert torch.equal(res, want_res) and torch.allclose(out, want, rtol=1e-5, atol=1e-5)
    assert layer(torch.randn(3, 256, generator=g)).shape == (3, 96)                          # more rows: scaled_mm
    assert calls == [True, True, True]                        # layer(x), norm_forward, the check's own product

"""INT8 and INT4 layers that make their own input at one row (the quantization chapter): the residual-add RMSNorm
before the QKV and gate/up projections and SiLU x up before the down projection taken into the one-row GEMV's
pairs paths (`F16`, `HALF2`), which read bf16 only; under the interpreter their PTX is emulated, so these run on
the CPU in bf16. The fused values are rounded where the kernels they replace round (to nearest even); the norm's
sum may come out one bf16 step apart (the order of its sum of squares), so products are compared within bf16
rounding, the new residual exactly."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import helpers
import nanoserve.quant as Q
from nanoserve.fused import add_rmsnorm, add_rmsnorm_ref, silu_mul
from nanoserve.model import AttentionMetadata, ModelKernels, PrefillChunk, Qwen2ForCausalLM, RMSNorm
from nanoserve.quant import QuantLinear, makes_input, quant_matmul_ref, quantize_model

pytestmark = pytest.mark.skipif(not Q.INTERPRET, reason="the pairs paths' emulation runs under the interpreter")
GROUP = 128


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def layer(method: str, N: int = 128, K: int = 512, bias: bool = False, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05, generator=g)
        if bias: lin.bias.normal_(0, 0.1, generator=g)
    q = QuantLinear.from_linear(lin.bfloat16(), method, GROUP)
    q.kernels, q.fuse_input = True, True
    return q


def silu_mul_rounded(gate_up: torch.Tensor) -> torch.Tensor:
    "silu(gate) * up with `silu_mul`'s two roundings to bf16."
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate).bfloat16().float() * up).bfloat16()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_one_bf16_row_is_taken_where_the_gemv_reads_pairs(method):
    q, x = layer(method), torch.randn(1, 512).bfloat16()
    assert q.fuses_input(x) and makes_input(128, 512, method, GROUP if method == "int4" else None, torch.bfloat16)
    assert not q.fuses_input(torch.randn(2, 512).bfloat16())             # two rows: the GEMM or the FMA GEMV
    assert not q.fuses_input(x.float())                                  # fp32: no pairs
    q.fuse_input = False
    assert not q.fuses_input(x)                                          # the control
    q.fuse_input, q.input_perm = True, torch.arange(512)
    assert q.fuses_input(x) and q.fuses_input(torch.randn(2, 512).bfloat16())   # act order: the norm gathers it
    assert not q.fuses_input(torch.randn(1, 1024).bfloat16())                   # the gate/up output: gathered first


def test_by_default_int8_makes_its_input_int4_does_not_and_act_order_gathers_in_the_gemv():
    """`fuse_input` None (a layer's default): INT8 layers make their norm and SiLU x up input at one row, INT4
    layers take them from kernels of their own, and an act-order layer of either gathers in the GEMV."""
    x = torch.randn(1, 512).bfloat16()
    q8, q4 = layer("int8"), layer("int4")
    q8.fuse_input = q4.fuse_input = None
    assert q8.fuses_input(x) and not q4.fuses_input(x) and not q4.gathers(x)
    q4.input_perm = torch.randperm(512, generator=torch.Generator().manual_seed(1))
    assert q4.gathers(x)


@pytest.mark.parametrize("method, made", [("int8", ["norm", "x", "norm", "act"]), ("int4", ["x"] * 4)])
def test_the_engines_default_table_makes_inputs_by_format(method, made, monkeypatch):
    "The kernel table's default (`quant_made_input=None`) leaves each layer's own default: INT8 made, INT4 apart."
    m = small_model(method)
    m.set_kernels(ModelKernels(add_rmsnorm=add_rmsnorm, silu_mul=silu_mul))
    assert all(mod.fuse_input is None for mod in m.modules() if isinstance(mod, QuantLinear))
    calls, real = [], Q.quant_gemv
    kind = lambda k: "norm" if k.get("norm") else "act" if k.get("act") else "x"
    monkeypatch.setattr(Q, "quant_gemv", lambda *a, **k: (calls.append(kind(k)), real(*a, **k))[1])
    one_token_logits(m)
    assert calls == made * 2                                             # QKV, o, gate/up, down; two layers


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("residual", [False, True])
def test_the_norm_taken_in_gives_the_unfused_products(method, residual):
    g = torch.Generator().manual_seed(3)
    q = layer(method, bias=True)
    x = (torch.randn(1, 512, generator=g) * 3).bfloat16()
    r = torch.randn(1, 512, generator=g).bfloat16() if residual else None
    norm = RMSNorm(512).bfloat16()
    with torch.no_grad(): norm.weight.uniform_(0.5, 1.5, generator=g)
    out, new_res = q.norm_forward(norm, x, r)
    if residual: normed, want_res = add_rmsnorm_ref(x, r, norm.weight, norm.eps)
    else: normed, want_res = add_rmsnorm_ref(x, None, norm.weight, norm.eps), x
    assert torch.equal(new_res, want_res)
    want = quant_matmul_ref(normed.float(), q.qweight, q.scales, q.zeros, q.bias.float(), method, q.group_size)
    assert out.dtype == torch.bfloat16 and rel(out, want) < 1e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_silu_mul_taken_in_gives_the_unfused_products(method):
    q = layer(method, N=256, K=512)
    gu = torch.randn(1, 1024, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = quant_matmul_ref(silu_mul_rounded(gu).float(), q.qweight, q.scales, q.zeros, None, method, q.group_size)
    assert rel(q.gate_up_forward(gu), want) < 1e-2


def test_what_cannot_be_made_is_refused():
    q8 = layer("int8")
    x, nw = torch.randn(1, 512).bfloat16(), torch.ones(512).bfloat16()
    args = (q8.qweight, q8.scales, q8.zeros, None, "int8")
    with pytest.raises(ValueError, match="pairs paths"):
        Q.quant_gemv(torch.randn(2, 512).bfloat16(), *args, norm=(nw, 1e-6))
    with pytest.raises(ValueError, match="not two"): Q.quant_gemv(x, *args, norm=(nw, 1e-6), act=True)
    with pytest.raises(ValueError, match="norm weight"): Q.quant_gemv(x, *args, norm=(nw.float(), 1e-6))
    with pytest.raises(ValueError, match="needs a norm"): Q.quant_gemv(x, *args, residual=x)


def small_model(method: str) -> Qwen2ForCausalLM:
    "A bf16 model whose every projection fits the pairs paths, quantized, its layers on the kernels."
    m = helpers.small_model(torch.bfloat16, hidden_size=256, intermediate_size=512, max_position_embeddings=64)
    quantize_model(m, method, GROUP)
    for mod in m.modules():
        if isinstance(mod, QuantLinear): mod.kernels = True
    return m


def one_token_logits(m, token: int = 7):
    cfg = m.config
    caches = [tuple(torch.zeros(1, 8, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16) for _ in range(2))
              for _ in range(cfg.num_hidden_layers)]
    ids = torch.tensor([token])
    meta = AttentionMetadata(torch.arange(1), prefills=[PrefillChunk(0, 1, 0, torch.arange(1))])
    return m.compute_logits(m(ids, torch.arange(1), caches, meta)).float()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_decoder_hands_quantized_layers_their_inputs_at_one_row(method, monkeypatch):
    """With the norm and SiLU kernels in the table and `quant_made_input` on, each INT8/INT4 QKV and gate/up layer gets
    the norm's input and each down layer the gate/up output at one row; off (the control), the kernels run apart.
    The logits agree within bf16 rounding."""
    m = small_model(method)
    m.set_kernels(ModelKernels(add_rmsnorm=add_rmsnorm, silu_mul=silu_mul, quant_made_input=False))
    apart = one_token_logits(m)
    m.set_kernels(ModelKernels(add_rmsnorm=add_rmsnorm, silu_mul=silu_mul, quant_made_input=True))
    assert all(mod.fuse_input for mod in m.modules() if isinstance(mod, QuantLinear))
    calls, real = [], Q.quant_gemv
    made = lambda k: "norm" if k.get("norm") else "act" if k.get("act") else "x"
    monkeypatch.setattr(Q, "quant_gemv", lambda *a, **k: (calls.append(made(k)), real(*a, **k))[1])
    fused = one_token_logits(m)
    assert calls == ["norm", "x", "norm", "act"] * 2                     # QKV, o, gate/up, down; two layers
    assert rel(fused, apart) < 3e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_one_act_order_row_is_gathered_in_the_gemv(method, monkeypatch):
    """A layer with an input order (a GPTQ act-order checkpoint's) at one row: with `fuse_input` the GEMV reads
    x[perm] as it loads, the same products as the gathered row through the same path, bit for bit; no
    `index_select` runs. Off, or at two rows, the row is gathered first, as before."""
    g = torch.Generator().manual_seed(8)
    q = layer(method, N=128, K=512)
    q.input_perm = torch.randperm(512, generator=g)
    x = torch.randn(1, 512, generator=g).bfloat16()
    want = Q.quant_gemv(x[:, q.input_perm].contiguous(), q.qweight, q.scales, q.zeros, None, method, q.group_size)
    selects = []
    select = lambda self, *a: (selects.append(a), torch.index_select(self, *a))[1]
    monkeypatch.setattr(torch.Tensor, "index_select", select)
    assert q.gathers(x) and torch.equal(q(x), want) and not selects
    q.fuse_input = False
    assert not q.gathers(x) and torch.equal(q(x), want) and len(selects) == 1
    q.fuse_input = True
    two = torch.randn(2, 512, generator=g).bfloat16()
    assert not q.gathers(two) and q(two).shape == (2, 128) and len(selects) == 2
    with pytest.raises(ValueError, match="input order"):
        Q.quant_gemv(x, q.qweight, q.scales, q.zeros, None, method, q.group_size, perm=q.input_perm.int())

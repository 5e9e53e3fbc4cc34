"""AWQ and GPTQ checkpoints through the engine (nanoserve.quant's loader, the engine's `_load`): random transformers
Qwen2 checkpoints written in each format's exact tensor layout (`quant.write_quantized`), served by `LLM` on the CPU,
against transformers' own model on the dequantized weights; and the variants and combinations that are refused."""
import pytest
import torch
from helpers import hf_greedy, with_tokenizer

from nanoserve.engine import LLM, SamplingParams
from nanoserve.fused import add_rmsnorm, silu_mul
from nanoserve.model import AttentionMetadata, ModelKernels, PrefillChunk
from nanoserve.quant import INTERPRET, QuantLinear, load_quantized_model, read_checkpoint_quant, write_quantized

VOCAB = 3072                    # the shipped tiny model's tokenizer


def checkpoint(tmp_path, fmt, act_order=False, write_bits=4, **overrides):
    "A quantized random checkpoint with the shipped tokenizer beside it; its transformers oracle."
    hf = write_quantized(tmp_path, fmt, act_order, vocab=VOCAB, bits=write_bits)
    with_tokenizer(tmp_path, **overrides)
    return hf


@pytest.mark.parametrize("fmt,act_order", [("awq", False), ("gptq", False), ("gptq", True)])
def test_engine_greedy_matches_transformers_on_the_dequantized_weights(tmp_path, fmt, act_order):
    hf = checkpoint(tmp_path, fmt, act_order)
    llm = LLM(tmp_path, device="cpu", dtype="float32", num_kv_blocks=64)
    assert all(isinstance(layer.mlp.down_proj, QuantLinear) for layer in llm.model.layers)
    assert llm.quant_report.method == fmt and llm.quant_report.num_replaced == 2 * 4
    prompts = [[5, 17, 300, 42, 9, 1200, 77], [1000, 3, 3, 3, 2500]]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    for prompt, out in zip(prompts, outs): assert out.token_ids == hf_greedy(hf, prompt, 12)[0]


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_8bit_loads_dequantized_and_matches_transformers(tmp_path, act_order):
    hf = checkpoint(tmp_path, "gptq", act_order, write_bits=8)
    llm = LLM(tmp_path, device="cpu", dtype="float32", num_kv_blocks=64)
    assert llm.checkpoint_quant.bits == 8 and llm.quant_report is None
    assert not any(isinstance(m, QuantLinear) for m in llm.model.modules())          # dense weights
    prompts = [[5, 17, 300, 42, 9, 1200, 77], [1000, 3, 3, 3, 2500]]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, sp)): assert out.token_ids == hf_greedy(hf, prompt, 12)[0]
    int8 = LLM(tmp_path, device="cpu", dtype="float32", num_kv_blocks=64, quantization="int8")   # ours on top
    assert int8.quant_report.method == "int8" and isinstance(int8.model.layers[0].mlp.down_proj, QuantLinear)


def test_refused_variants_and_combinations(tmp_path):
    checkpoint(tmp_path / "g3", "gptq", bits=3)
    with pytest.raises(ValueError, match="gptq checkpoint: bits 3"): LLM(tmp_path / "g3", device="cpu")
    checkpoint(tmp_path / "awqv", "awq", version="gemv")
    with pytest.raises(ValueError, match="version 'gemv'"): LLM(tmp_path / "awqv", device="cpu")
    checkpoint(tmp_path / "a", "awq")
    with pytest.raises(ValueError, match="already quantized \\(awq\\): leave quantization unset"):
        LLM(tmp_path / "a", device="cpu", quantization="int4")


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    "The logits of one prefill of `ids` over a fresh cache of one block."
    cfg, T = model.config, len(ids)
    caches = [tuple(torch.zeros(1, T, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2))
              for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(torch.arange(T), prefills=[PrefillChunk(0, T, 0, torch.arange(1))])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(T), caches, meta)).float()


@pytest.mark.skipif(not INTERPRET, reason="the kernels run under the interpreter here")
def test_act_order_gathers_nothing_on_the_kernels(tmp_path, monkeypatch):
    """A GPTQ act-order checkpoint on the kernels: the norms write the QKV and gate/up inputs in those layers' order
    (`add_rmsnorm_gather`), the down projection's order is folded into gate/up's rows at load, and the attention
    stores the output projection's input in its order (`out_dest`), so no projection gathers its input (no
    `index_select`, where there were four a layer); the logits are the torch path's."""
    write_quantized(tmp_path, "gptq", True, vocab=VOCAB)
    m = load_quantized_model(tmp_path, read_checkpoint_quant(tmp_path), torch.float32)
    layers = [mod for mod in m.modules() if isinstance(mod, QuantLinear)]
    assert [mod.input_perm is not None for mod in layers] == [True, True, True, False] * m.config.num_hidden_layers
    ids = [5, 17, 300, 42, 9, 1200, 77]
    want = prefill_logits(m, ids)                                        # the torch path: every input gathered
    perms, selects, select = {id(mod.input_perm) for mod in layers}, [], torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select",
                        lambda self, dim, index: (selects.append(id(index) in perms), select(self, dim, index))[1])
    for mod in layers: mod.kernels = True
    m.set_kernels(ModelKernels(add_rmsnorm=add_rmsnorm, silu_mul=silu_mul))
    got = prefill_logits(m, ids)
    assert sum(selects) == 0                                             # every order made by a store
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_an_act_order_layer_keeps_where_each_input_goes(tmp_path):
    "`input_dest`, the inverse of `input_perm` (the norm's kernel scatters to it), derived at load, not saved."
    write_quantized(tmp_path, "gptq", True, vocab=VOCAB)
    m = load_quantized_model(tmp_path, read_checkpoint_quant(tmp_path), torch.float32)
    act = [mod for mod in m.modules() if isinstance(mod, QuantLinear) and mod.input_perm is not None]
    assert act and all(torch.equal(mod.input_dest[mod.input_perm], torch.arange(mod.in_features)) for mod in act)
    assert not any(k.endswith("input_dest") for k in m.state_dict())


GATHER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import nanoserve.quant as Q
k = Q.add_rmsnorm_gather_kernel
sig = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "dest_ptr": "*i64", "out_ptr": "*bf16",
       "new_residual_ptr": "*bf16", "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_nr": "i32"}
consts = {"HIDDEN": 3584, "BLOCK": 4096, "HAS_RESIDUAL": True, "PDL": True}
src = ASTSource(fn=k, signature={n: sig.get(n, "constexpr") for n in k.arg_names},
                constexprs={(i,): consts[n] for i, n in enumerate(k.arg_names) if n in consts})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
body = ptx[ptx.index("griddepcontrol.wait"):]
print(ptx.count("griddepcontrol.wait"), ptx.count("ld.global") - body.count("ld.global"), body.count("st.global"))
"""


def test_the_gathering_norm_compiles_for_hopper():
    """`add_rmsnorm_gather_kernel` in bf16 with PDL, compiled for sm_90 on the CPU: one wait, the destinations and the
    norm's weight (weights) loaded before it, the sum and the output stored after it."""
    from helpers import compiled_run
    waits, loads_before, stores_after = map(int, compiled_run(GATHER_COMPILE).split())
    assert waits == 1 and loads_before > 0 and stores_after > 0, (waits, loads_before, stores_after)

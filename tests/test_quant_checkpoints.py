"""AWQ and GPTQ checkpoints through the engine (nanoserve.quant's loader, the engine's `_load`): random transformers
Qwen2 checkpoints written in each format's exact tensor layout (`quant.write_quantized`), served by `LLM` on the CPU,
against transformers' own model on the dequantized weights; and the variants and combinations that are refused."""
import pytest
import torch
from helpers import hf_greedy, with_tokenizer

from nanoserve.engine import LLM, SamplingParams
from nanoserve.quant import QuantLinear, write_quantized

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

"""fp8 checkpoints through the engine (nanoserve.quant's `load_dequantized_model`, the engine's `_load`): random
transformers checkpoints of each family written as fp8 checkpoints store them (`quant.write_fp8`: e4m3 weights with
128 x 128 block scales as Qwen3's releases, or one scale a tensor with input scales), served by `LLM` on the CPU,
against transformers' own model on the dequantized weights; quantization on top of the dequantized weights; what is
refused."""
import pytest
import torch
from helpers import hf_greedy, with_tokenizer

from nanoserve.engine import LLM, SamplingParams
from nanoserve.quant import QuantLinear, write_fp8

VOCAB = 3072                    # the shipped tiny model's tokenizer
PROMPTS = [[5, 17, 300, 42, 9, 1200, 77], [1000, 3, 3, 3, 2500]]


def checkpoint(folder, block=(128, 128), family="Qwen3", **overrides):
    "An fp8 random checkpoint with the shipped tokenizer beside it; its transformers oracle."
    hf = write_fp8(folder, block, family, vocab_size=VOCAB)
    with_tokenizer(folder, **overrides)
    return hf


@pytest.mark.parametrize("family,block", [("Qwen3", (128, 128)), ("Llama", (64, 32)), ("Mistral", None)])
def test_engine_greedy_matches_transformers_on_the_dequantized_weights(tmp_path, family, block):
    hf = checkpoint(tmp_path, block, family)
    llm = LLM(tmp_path, device="cpu", dtype="float32", num_kv_blocks=64)
    assert llm.checkpoint_quant.method == "fp8" and llm.checkpoint_quant.weight_block == block
    assert llm.quant_report is None and llm.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, sp)): assert out.token_ids == hf_greedy(hf, prompt, 12)[0]


def test_quantization_on_top_of_the_dequantized_weights(tmp_path):
    checkpoint(tmp_path)
    llm = LLM(tmp_path, device="cpu", dtype="float32", num_kv_blocks=64, quantization="int8")
    assert llm.quant_report.method == "int8" and isinstance(llm.model.layers[1].self_attn.qkv_proj, QuantLinear)
    plain = LLM(tmp_path, device="cpu", dtype="float32", num_kv_blocks=64)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    a, b = llm.generate(PROMPTS, sp), plain.generate(PROMPTS, sp)
    assert all(len(x.token_ids) == 8 for x in a)
    assert sum(x == y for p, q in zip(a, b) for x, y in zip(p.token_ids, q.token_ids)) >= 8   # INT8: close, not equal


def test_refused_variants_and_combinations(tmp_path):
    checkpoint(tmp_path / "e5", fmt="e5m2")
    with pytest.raises(ValueError, match="fp8 checkpoint: fmt 'e5m2'"): LLM(tmp_path / "e5", device="cpu")
    checkpoint(tmp_path / "blk", weight_block_size=[128])
    with pytest.raises(ValueError, match="weight_block_size \\[128\\]"): LLM(tmp_path / "blk", device="cpu")
    checkpoint(tmp_path / "mis", weight_block_size=[64, 64])            # written in 128 x 128 blocks
    with pytest.raises(ValueError, match="in 64 x 64 blocks has"): LLM(tmp_path / "mis", device="cpu")
    checkpoint(tmp_path / "tp")
    with pytest.raises(ValueError, match="fp8 checkpoints with tensor_parallel_size > 1"):
        LLM(tmp_path / "tp", device="cpu", tensor_parallel_size=2)

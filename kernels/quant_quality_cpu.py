"""What quantization costs in quality, on a CPU: the trained tiny model and the Qwen2.5-0.5B shape with random weights.

Run on any machine from the repo root (about half a minute on two cores):
    PYTHONPATH=. python kernels/quant_quality_cpu.py --out figures/data
Writes quant_quality_cpu.json (run metadata inside), which the quantization chapter reads and draws:
- tiny: the shipped tiny model (4 layers, hidden 256, intermediate 688) in fp32, on held-out rows of the standard
  library it never trained on, one full-sequence forward per row, INT8, INT4 in groups of 16 and 8 (688 admits
  no group of 32 or more) and fp8 W8A8 (`quantization="fp8"`: e4m3 weights and activations, method "fp8"), with and
  without the LM head quantized: the logits' relative error, the mean KL(full ||
  quantized) a token, top-1 agreement and the perplexity against the full-precision model; and the K/V cache in fp8
  e4m3 and in int8 with a scale a row, with full-precision weights ("kv_fp8", "kv_int8": every key and value rounded as
  the engine's cache of that dtype stores it; "kv_in_bf16": the same caches under the model in bf16, against the
  bf16 cache, the issue's own measure);
  and the weights as fp8 checkpoints store them ("fp8 128x128": e4m3 with a scale per 128 x 128 block of each
  projection, as Qwen3's releases; "fp8 tensor": one scale a projection), dequantized as the loader reads them;
- 0.5B: all 24 layers of the 0.5B shape with random weights (std 0.02) in fp32, 128 random tokens, one forward per
  format, INT8, INT4 in groups of 32, 64 and 128, fp8 W8A8, kv_fp8, kv_int8 and the fp8 checkpoints' weights: the
  same measures but perplexity
  (random targets mean nothing).
Checked before it is written: INT8 closer than INT4 on both, INT4's error falling with the group on the 0.5B shape.
`--smoke`: the same code, two short rows of the tiny model and a two-layer random model of the tiny shape.
"""
import copy, math, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import is_smoke, parser, write

import torch

from nanoserve.model import (AttentionMetadata, ModelConfig, PrefillChunk, Qwen2ForCausalLM, SHAPES, load_model,
                             make_kv_cache)
from nanoserve.quant import fp8_dequantize, fp8_quantize, logit_quality, quantize_model
from nanoserve.tokenizer import default_model
from nanoserve.train import heldout_rows

TINY_CONFIGS = [("int8", None, False), ("int4", 16, False), ("int4", 8, False), ("fp8", None, False),
                ("int8", None, True), ("int4", 16, True), ("fp8", None, True),
                ("int4", 16, "int8")]                  # an INT4 model with its LM head (the tied table) in INT8
BIG_CONFIGS = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("fp8", None)]
KV_CACHES = (("kv_fp8", torch.float8_e4m3fn), ("kv_int8", torch.int8))   # one-byte caches, the weights full precision
FP8_WEIGHTS = (("fp8 128x128", (128, 128)), ("fp8 tensor", None))     # fp8 checkpoints' weight scales


def fp8_weights(model, block) -> tuple:
    "(a copy of `model` with each projection's weight through e4m3 and back, its projections' bytes before, stored)."
    m, before, stored = copy.deepcopy(model), 0, 0
    for name, p in m.named_parameters():
        if name.endswith("_proj.weight"):
            values, scale = fp8_quantize(p.data, block)
            p.data.copy_(fp8_dequantize(values, scale, block))
            before, stored = before + p.numel() * p.element_size(), stored + values.numel() + 4 * scale.numel()
    return m, before, stored


def sequence_logits(model, ids: torch.Tensor, block_size: int = 16, cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits [T, vocab] of one sequence `ids` [T], as one prefill chunk over a fresh paged cache (of `cache_dtype`;
    None: the model's). The chunk's attention reads its keys and values back from the cache, as rounded there."""
    cfg, T = model.config, ids.numel()
    dev = model.norm.weight.device
    dtype = cache_dtype or model.norm.weight.dtype
    nb = -(-T // block_size)
    cache = make_kv_cache(cfg.num_hidden_layers, nb, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, dev)
    caches = [(c[0], c[1]) for c in cache]                                            # each layer's (keys, values)
    table = torch.arange(nb, device=dev)
    meta = AttentionMetadata(torch.arange(T, device=dev), prefills=[PrefillChunk(0, T, 0, table)],
                             prefill_block_tables=table[None], prefill_cu_q_lens=torch.tensor([0, T], device=dev),
                             prefill_start_pos=torch.zeros(1, dtype=torch.long, device=dev), prefill_max_q_len=T)
    with torch.no_grad():
        return model.compute_logits(model(ids.to(dev), torch.arange(T, device=dev), caches, meta))


def random_model(shape: dict, seed: int = 0, std: float = 0.02) -> Qwen2ForCausalLM:
    "Our Qwen2 with random fp32 weights of a shape (norm weights 1), built on the CPU."
    cfg = ModelConfig(**shape, max_position_embeddings=4096, dtype="float32")
    with torch.device("meta"): m = Qwen2ForCausalLM(cfg)
    m = m.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"): p.fill_(1.0)
            else: p.normal_(0.0, std, generator=gen)
    m.rotary.build("cpu", torch.float32)
    return m.eval().requires_grad_(False)


def tiny_quality(smoke: bool) -> dict:
    "The trained tiny model's rows: every format against the full-precision model, perplexity included."
    tiny_dir = default_model()
    rows = heldout_rows(tiny_dir / "tokenizer.json", num_rows=2 if smoke else 16, seq_len=32 if smoke else 256)
    tiny = load_model(tiny_dir, dtype=torch.float32)
    logits = lambda m: torch.cat([sequence_logits(m, r[:-1]) for r in rows])        # [rows * seq_len, V]
    targets, ref = rows[:, 1:].reshape(-1), logits(tiny)
    out = []
    for method, G, head in TINY_CONFIGS:
        m = copy.deepcopy(tiny)
        rep = quantize_model(m, method, G or 128, quantize_lm_head=head)
        qual = logit_quality(ref, logits(m), targets)
        out.append({"method": method, "group_size": G, "lm_head": head, **qual, "ppl_ref": math.exp(qual["nll_ref"]),
                    "ppl_quant": math.exp(qual["nll_quant"]), "weight_bytes_before": rep.weight_bytes_before,
                    "weight_bytes_after": rep.weight_bytes_after})
        print(out[-1], flush=True)
    for method, cache_dtype in KV_CACHES:
        qual = logit_quality(ref, torch.cat([sequence_logits(tiny, r[:-1], cache_dtype=cache_dtype) for r in rows]),
                             targets)
        out.append({"method": method, "group_size": None, "lm_head": False, **qual,
                    "ppl_ref": math.exp(qual["nll_ref"]), "ppl_quant": math.exp(qual["nll_quant"])})
        print(out[-1], flush=True)
    for method, block in FP8_WEIGHTS:
        m, before, stored = fp8_weights(tiny, block)
        qual = logit_quality(ref, logits(m), targets)
        out.append({"method": method, "group_size": None, "lm_head": False, **qual, "ppl_ref": math.exp(qual["nll_ref"]),
                    "ppl_quant": math.exp(qual["nll_quant"]), "weight_bytes_before": before, "weight_bytes_after": stored})
        print(out[-1], flush=True)
    bf16 = load_model(tiny_dir, dtype=torch.bfloat16)           # the measure: against the bf16 cache, in bf16
    bf16_logits = lambda dt: torch.cat([sequence_logits(bf16, r[:-1], cache_dtype=dt) for r in rows]).float()
    bf16_ref, kv_bf16 = bf16_logits(None), []
    for method, cache_dtype in KV_CACHES:
        qual = logit_quality(bf16_ref, bf16_logits(cache_dtype), targets)
        kv_bf16.append({"method": method, **qual, "ppl_ref": math.exp(qual["nll_ref"]),
                        "ppl_quant": math.exp(qual["nll_quant"])})
        print("bf16 model", kv_bf16[-1], flush=True)
    return {"model": "tiny-qwen2-stdlib (shipped, fp32)", "rows": int(rows.shape[0]), "seq_len": int(rows.shape[1] - 1),
            "results": out, "kv_in_bf16": {"model": "the same in bf16 (torch reference path), against the bf16 cache",
                                           "results": kv_bf16}}


def big_quality(smoke: bool) -> dict:
    "The 0.5B shape (a two-layer tiny shape under --smoke) with random weights: every format, one forward each."
    shape = dict(SHAPES["0.5B"], **({"num_hidden_layers": 2, "vocab_size": 4096} if smoke else {}))
    big = random_model(shape)
    ids = torch.randint(0, big.config.vocab_size, (32 if smoke else 128,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter(); ref = sequence_logits(big, ids); fwd_s = time.perf_counter() - t0
    out = []
    for method, G in BIG_CONFIGS:
        m = copy.deepcopy(big)
        t0 = time.perf_counter(); rep = quantize_model(m, method, G or 128); q_s = time.perf_counter() - t0
        t0 = time.perf_counter(); qual = logit_quality(ref, sequence_logits(m, ids)); f_s = time.perf_counter() - t0
        out.append({"method": method, "group_size": G, "lm_head": False, **qual, "quantize_s": q_s, "forward_s": f_s,
                    "weight_bytes_before": rep.weight_bytes_before, "weight_bytes_after": rep.weight_bytes_after})
        print(out[-1], flush=True)
        del m
    for method, cache_dtype in KV_CACHES:
        t0 = time.perf_counter()
        qual = logit_quality(ref, sequence_logits(big, ids, cache_dtype=cache_dtype))
        out.append({"method": method, "group_size": None, "lm_head": False, **qual,
                    "forward_s": time.perf_counter() - t0})
        print(out[-1], flush=True)
    for method, block in FP8_WEIGHTS:
        m, before, stored = fp8_weights(big, block)
        qual = logit_quality(ref, sequence_logits(m, ids))
        out.append({"method": method, "group_size": None, "lm_head": False, **qual, "weight_bytes_before": before,
                    "weight_bytes_after": stored})
        print(out[-1], flush=True)
        del m
    what = "two layers of" if smoke else "all 24 layers of"
    return {"model": f"random weights of the Qwen2.5-0.5B shape (std 0.02), fp32, {what} it",
            "tokens": int(ids.numel()), "full_forward_s": fwd_s, "results": out}


def check(tiny: dict, big: dict) -> None:
    """INT8 closer than INT4 on both models; on the 0.5B shape INT4's error falls with the group size, and the fp8
    weights are closer than INT4 in groups of 32."""
    t = {(r["method"], r["group_size"], r["lm_head"]): r for r in tiny["results"]}
    assert t[("int8", None, False)]["logit_rel_err"] < t[("int4", 16, False)]["logit_rel_err"]
    assert t[("int4", 16, "int8")]["kl_mean"] < t[("int4", 16, True)]["kl_mean"]       # the INT8 head: less error
    b = {(r["method"], r["group_size"]): r for r in big["results"]}
    assert b[("int8", None)]["logit_rel_err"] < b[("int4", 32)]["logit_rel_err"] < b[("int4", 128)]["logit_rel_err"]
    assert all(b[(m, None)]["logit_rel_err"] < b[("int4", 32)]["logit_rel_err"] for m, _ in FP8_WEIGHTS)


def main():
    args = parser(__doc__, out="figures/data").parse_args()
    smoke = is_smoke(args)
    t_all = time.perf_counter()
    tiny, big = tiny_quality(smoke), big_quality(smoke)
    check(tiny, big)
    write("quant_quality_cpu.json", {"cpu_threads": torch.get_num_threads(), "tiny": tiny, "0.5B": big,
                                     "seconds": time.perf_counter() - t_all}, args)


if __name__ == "__main__":
    main()

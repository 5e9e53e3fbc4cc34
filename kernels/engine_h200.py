"""The engine against transformers on the same weights, then its decode step, on the GPU.

    PYTHONPATH=. python kernels/engine_h200.py --out $OUT      # engine_h200.json; copy it to figures/data/

With random weights of the Qwen2.5-0.5B shape in bf16, in the tutorials' order:
1. check: our logits vs transformers' Qwen2ForCausalLM on the same weights (bf16), both against an fp32
   transformers reference (relative error); greedy tokens of ours vs transformers' generate (agreeing prefix), in
   bf16 and in fp32 (where random weights' near-ties no longer flip);
2. time: the decode step of our engine at several batch sizes for each attention backend (GPU warmed before every
   row, each row measured twice, >15% apart flagged; ms per `LLM.step()` by the host's clock with the device
   synchronised); device kernels per step and GPU busy share from one profiled window (`nanoserve.measure`);
   transformers' eager generate at batch 1 in the same run, as the yardstick;
3. write engine_h200.json (with the run's metadata).
`--smoke`: a two-layer model of odd small sizes on the CPU under the Triton interpreter, fp32; writes only to a
temporary folder.
"""
import os, random, shutil, sys, tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SamplingParams, device_or_skip, is_smoke, median, parser, rel_err, run_parts, steady_decode,
                 sync, time_wall, tiny_model, twice, warm, write)

import torch

from nanoserve.measure import busy_share, count_device_kernels, profile_run
from nanoserve.model import SHAPES as MODEL_SHAPES, AttentionMetadata, PrefillChunk

SHAPES = {"0.5B": dict(MODEL_SHAPES["0.5B"]),
          "smoke": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=3072, tie_word_embeddings=True)}


def make_checkpoint(path: Path, shape: str, device, dtype, seed: int = 0):
    "Random transformers Qwen2 weights of `shape` (biases drawn too) saved to `path` with the tiny tokenizer."
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
    with torch.device(device): hf = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"): p.normal_(0, 0.02)
    hf = hf.to(dtype).eval()
    hf.save_pretrained(path)
    tiny = tiny_model()                                 # any tokenizer will do: prompts are token ids
    for f in os.listdir(tiny):
        if f.startswith("tokenizer") or f in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            shutil.copy(os.path.join(tiny, f), path)
    return hf


def prefill_logits(llm, ids):
    "Our model's logits for one prompt `ids` [1, n] through a hand-built paged-cache prefill (fresh engine)."
    dev, n = ids.device, ids.shape[1]
    table = torch.arange(-(-n // llm.block_size), device=dev)
    meta = AttentionMetadata(torch.arange(n, device=dev), prefills=[PrefillChunk(0, n, 0, table)],
                             prefill_block_tables=table[None], prefill_max_q_len=n,
                             prefill_cu_q_lens=torch.tensor([0, n], device=dev),
                             prefill_start_pos=torch.zeros(1, dtype=torch.long, device=dev))
    with torch.inference_mode():
        return llm.model.compute_logits(llm.model(ids[0], torch.arange(n, device=dev), llm.runner.kv_caches, meta))


def greedy_agreement(hf, llm, ids, n_new: int) -> dict:
    "transformers' greedy tokens against ours for the prompt `ids`: the agreeing prefix."
    n = ids.shape[1]
    theirs = hf.generate(ids, max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)[0, n:].tolist()
    ours = llm.generate(ids[0].tolist(), SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))[0].token_ids
    agree = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), n_new)
    return {"tokens": n_new, "agreeing_prefix": agree, "identical": theirs == ours}


def free(device):
    if torch.device(device).type == "cuda": torch.cuda.empty_cache()


def correctness(hf, model_dir, res, device, dtype, smoke):
    if not smoke:                                       # the KV cache sized from free memory and a measured peak
        sized = LLM(model_dir, dtype="bfloat16")
        res["kv_sizing"] = {"num_kv_blocks": sized.num_kv_blocks, "block_size": sized.block_size,
                            "activation_peak_mib": sized.activation_peak_bytes / 2**20,
                            "kv_cache_gib": sized.runner.kv_cache.numel() * 2 / 2**30,
                            "max_model_len": sized.max_model_len}
        del sized; free(device)
    name = str(dtype).removeprefix("torch.")
    llm = LLM(model_dir, dtype=name, num_kv_blocks=256 if smoke else 2048, max_num_seqs=8)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, llm.config.vocab_size, (1, 24 if smoke else 64), generator=g).to(device)
    with torch.no_grad():
        ref32 = hf.float()(ids).logits[0, -1].double(); hf.to(dtype)
        theirs = hf(ids).logits[0, -1]
    ours = prefill_logits(llm, ids)[-1]
    # the keys say bf16, as in the data files (under --smoke the run is in fp32 and "dtype" says so)
    res["logits"] = {"dtype": name, "ours_bf16_vs_fp32_rel": rel_err(ours, ref32),
                     "hf_bf16_vs_fp32_rel": rel_err(theirs, ref32),
                     "ours_vs_hf_bf16_max_abs": (ours.float() - theirs.float()).abs().max().item(),
                     "argmax_equal": bool(ours.argmax() == theirs.argmax())}
    print("logits", res["logits"], flush=True)
    err = res["logits"]
    assert err["ours_bf16_vs_fp32_rel"] < 2 * err["hf_bf16_vs_fp32_rel"] + 1e-4, err   # no worse than rounding
    n_new = 8 if smoke else 64
    res["greedy"] = greedy_agreement(hf, llm, ids, n_new)
    del llm; free(device)
    hf.float()                                          # fp32: both sides should agree on every token
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256 if smoke else 2048, max_num_seqs=8)
    res["greedy_fp32"] = dict(greedy_agreement(hf, llm, ids, n_new), backend=llm.attention_backend)
    print("greedy", res["greedy"], "fp32", res["greedy_fp32"], flush=True)
    assert res["greedy_fp32"]["identical"], res["greedy_fp32"]
    del llm; hf.to(dtype); free(device)


def decode_timing(model_dir, res, backend, dtype, device, smoke):
    "ms per decode step at each batch size, measured twice; kernels per step and busy share from a profile."
    batches, steps, profiled = ((2,), 2, 1) if smoke else ((1, 8, 32, 64), 64, 16)   # the interpreter: ~0.5 s a step
    llm = LLM(model_dir, dtype=str(dtype).removeprefix("torch."), num_kv_blocks=256 if smoke else 8192,
              max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches)), attention_backend=backend)
    rows = []
    for b in batches:
        steady_decode(llm, b, prompt_len=16 if smoke else 128, seed=2)
        warm(llm.device)
        a, c, flag = twice(lambda: median(time_wall(llm.step, steps, warmup=1, device=llm.device)) * 1e3)
        with profile_run(llm.device) as run:
            for _ in range(profiled): llm.step()
        n = profiled
        rows.append({"backend": backend, "batch": b, "ms_per_step": [a, c], "disagree": flag,
                     "tokens_per_s": b / (min(a, c) / 1e3), "kernels_per_step": count_device_kernels(run.events) / n,
                     "gpu_busy": busy_share(run) if llm.device.type == "cuda" else None,
                     "profiled_ms_per_step": run.wall_s / n * 1e3})
        print(rows[-1], flush=True)
    res.setdefault("decode", []).extend(rows)
    for i in list(llm._requests): llm.abort_request(i)
    del llm; free(device)


def hf_eager(hf, res, device, smoke):
    "transformers eager generate, batch 1: ms per decode step = (t(n + steps) - t(n)) / steps, measured twice."
    steps = 4 if smoke else 64
    ids = torch.randint(0, hf.config.vocab_size, (1, 16 if smoke else 128)).to(device)
    def gen(n): return hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    gen(8); warm(device)

    def per_step():
        short = median(time_wall(lambda: gen(8), 1, warmup=0, device=device))
        long = median(time_wall(lambda: gen(8 + steps), 1, warmup=0, device=device))
        return (long - short) / steps * 1e3
    a, b, flag = twice(per_step)
    res["hf_eager_batch1_ms_per_step"], res["hf_eager_disagree"] = [a, b], flag


def main():
    ap = parser(__doc__, parts="correctness,decode_torch,decode_triton,hf_eager")
    args = ap.parse_args()
    smoke, device = is_smoke(args), device_or_skip(args)
    dtype = torch.float32 if smoke else torch.bfloat16
    shape = "smoke" if smoke else "0.5B"
    res = {"shape": shape, "dtype": str(dtype).removeprefix("torch.")}
    d = Path(tempfile.mkdtemp(prefix="nanoserve-engine-"))
    try:
        hf = make_checkpoint(d, shape, device, dtype)
        parts = {"correctness": lambda: correctness(hf, d, res, device, dtype, smoke),
                 "decode_torch": lambda: decode_timing(d, res, "torch", dtype, device, smoke),
                 "decode_triton": lambda: decode_timing(d, res, "triton", dtype, device, smoke),
                 "hf_eager": lambda: hf_eager(hf, res, device, smoke)}
        errors = {}

        def save(name, err):
            if err: errors[name] = err
            write("engine_h200.json", res | {f"{k}_error": v for k, v in errors.items()}, args)
        run_parts(parts, args.parts, save)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if errors: raise SystemExit(f"failed: {', '.join(errors)}")


if __name__ == "__main__":
    main()

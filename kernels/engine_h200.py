"""Engine check and decode timing on the GPU (issue: Qwen2 on the paged cache).

Run on the device machine from the repo root:  PYTHONPATH=. python kernels/engine_h200.py --out $OUT
Writes engine_h200.json (raw numbers, git sha, GPU, versions, date) to --out; copy it to figures/data/.

What it does, with random weights of the Qwen2.5-0.5B shape in bf16 (BRIEF.md):
1. correctness: our logits vs transformers' Qwen2ForCausalLM on the same weights (bf16), both against an fp32
   transformers reference (relative error); greedy tokens of ours vs transformers' generate (agreeing prefix).
2. decode step time of our engine at several batch sizes: warm-up of several seconds before every row, each
   row timed twice (flag > 15% disagreement), ms per step from CUDA-synchronised wall time of engine.step().
3. device kernels per decode step and GPU busy share from one profiled run (device kernels only; busy = union
   of kernel intervals / wall time of the same profiled steps).
4. transformers eager generate at batch 1 in the same run, as the side-by-side yardstick.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

import torch

SHAPES = {"0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)}


from nanoserve.bench import run_meta as meta_info   # git sha, GPU, versions, date


def make_checkpoint(path: Path, shape: str, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from nanoserve.tokenizer import ensure_default_model
    torch.manual_seed(seed)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)
    with torch.device("cuda"): hf = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"): p.normal_(0, 0.02)
    hf = hf.to(torch.bfloat16).eval()
    hf.save_pretrained(path)
    tiny = ensure_default_model()                       # any tokenizer will do: prompts are token ids
    for f in os.listdir(tiny):
        if f.startswith("tokenizer") or f in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            shutil.copy(os.path.join(tiny, f), path)
    return hf


def rel_err(a, b): return ((a.float() - b.float()).norm() / b.float().norm()).item()


def correctness(hf, model_dir, res):
    from nanoserve.engine import LLM, SamplingParams
    sized = LLM(model_dir, dtype="bfloat16")            # KV cache sized from free memory and a measured peak
    res["kv_sizing"] = {"num_kv_blocks": sized.num_kv_blocks, "block_size": sized.block_size,
                        "activation_peak_mib": sized.activation_peak_bytes / 2**20,
                        "kv_cache_gib": sized.runner.kv_cache.numel() * 2 / 2**30, "max_model_len": sized.max_model_len}
    del sized; torch.cuda.empty_cache()
    llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=2048, max_num_seqs=8)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 151936, (1, 64), generator=g).cuda()
    with torch.no_grad():
        ref32 = hf.float()(ids).logits[0, -1].double(); hf.to(torch.bfloat16)
        hf16 = hf(ids).logits[0, -1]
    # ours: the same prompt through our engine's model (one prefill), logits of the last position
    from nanoserve.model import AttentionMetadata, PrefillChunk
    runner = llm.runner
    n = ids.shape[1]
    table = torch.arange(-(-n // llm.block_size), device="cuda")
    meta = AttentionMetadata(torch.arange(n, device="cuda"), prefills=[PrefillChunk(0, n, 0, table)],
                             prefill_block_tables=table[None], prefill_max_q_len=n,
                             prefill_cu_q_lens=torch.tensor([0, n], device="cuda"),
                             prefill_start_pos=torch.zeros(1, dtype=torch.long, device="cuda"))
    with torch.inference_mode():
        ours = llm.model.compute_logits(llm.model(ids[0], torch.arange(n, device="cuda"), runner.kv_caches, meta))[-1]
    res["logits"] = {"ours_bf16_vs_fp32_rel": rel_err(ours, ref32), "hf_bf16_vs_fp32_rel": rel_err(hf16, ref32),
                     "ours_vs_hf_bf16_max_abs": (ours.float() - hf16.float()).abs().max().item(),
                     "argmax_equal": bool(ours.argmax() == hf16.argmax())}
    n_new = 64
    out_hf = hf.generate(ids, max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)[0, n:].tolist()
    out_ours = llm.generate(ids[0].tolist(), SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))[0].token_ids
    agree = next((i for i, (a, b) in enumerate(zip(out_hf, out_ours)) if a != b), n_new)
    res["greedy"] = {"tokens": n_new, "agreeing_prefix": agree, "identical": out_hf == out_ours}
    del llm; torch.cuda.empty_cache()
    # the same in fp32, where both sides should agree on every token (random weights give near-tied logits,
    # which bf16 rounding flips early)
    hf.float()
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=2048, max_num_seqs=8)
    out_hf = hf.generate(ids, max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)[0, n:].tolist()
    out_ours = llm.generate(ids[0].tolist(), SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))[0].token_ids
    agree = next((i for i, (a, b) in enumerate(zip(out_hf, out_ours)) if a != b), n_new)
    res["greedy_fp32"] = {"tokens": n_new, "agreeing_prefix": agree, "identical": out_hf == out_ours,
                          "backend": llm.attention_backend}
    del llm; hf.to(torch.bfloat16); torch.cuda.empty_cache()


def warm(fn, seconds=3.0):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds: fn()


def busy_and_kernels(fn, num_steps):
    "Device kernels per step and busy share, from one profiled run."
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps): fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]   # device kernels/memcpys only
    kernels = [e for e in evs if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    iv = sorted((e.time_range.start, e.time_range.end) for e in evs)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None: busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else: cur_e = max(cur_e, e)
    if cur_e is not None: busy += cur_e - cur_s
    return len(kernels) / num_steps, busy / 1e6 / wall, wall / num_steps * 1e3   # us -> s


def decode_timing(model_dir, res, backend, batches=(1, 8, 32, 64), steps=64):
    from nanoserve.engine import LLM, SamplingParams
    llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=8192, max_num_seqs=max(batches),
              max_num_batched_tokens=max(2048, max(batches)), attention_backend=backend)
    rows = []
    g = torch.Generator().manual_seed(2)
    for b in batches:
        def start():
            for i in list(llm._requests): llm.abort_request(i)
            for _ in range(b):
                llm.add_request(torch.randint(0, 151936, (128,), generator=g).tolist(),
                                SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
            while any(r.seq.num_computed_tokens < r.seq.num_prompt_tokens for r in llm._requests.values()):
                llm.step()                                           # finish prefill: decode-only from here
        def one_step(): llm.step()
        start(); warm(one_step, 3.0)
        times = []
        for rep in range(2):
            start(); torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(steps): one_step()
            torch.cuda.synchronize(); times.append((time.perf_counter() - t0) / steps * 1e3)
        start()
        kps, busy, prof_ms = busy_and_kernels(one_step, 16)
        rows.append({"backend": backend, "batch": b, "ms_per_step": times, "disagree": abs(times[0] - times[1]) / min(times) > 0.15,
                     "tokens_per_s": b / (min(times) / 1e3), "kernels_per_step": kps, "gpu_busy": busy,
                     "profiled_ms_per_step": prof_ms})
        print(rows[-1], flush=True)
    res.setdefault("decode", []).extend(rows)
    for i in list(llm._requests): llm.abort_request(i)
    del llm; torch.cuda.empty_cache()


def hf_eager(hf, res, steps=64):
    "transformers eager generate, batch 1: ms per decode step = (t(n+steps) - t(n)) / steps."
    ids = torch.randint(0, 151936, (1, 128)).cuda()
    def gen(n): return hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    warm(lambda: gen(8), 3.0)
    times = []
    for rep in range(2):
        torch.cuda.synchronize(); t0 = time.perf_counter(); gen(8); torch.cuda.synchronize(); t1 = time.perf_counter()
        gen(8 + steps); torch.cuda.synchronize(); t2 = time.perf_counter()
        times.append(((t2 - t1) - (t1 - t0)) / steps * 1e3)
    res["hf_eager_batch1_ms_per_step"] = times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res = {"meta": meta_info(), "shape": "0.5B", "dtype": "bfloat16",
           "command": "PYTHONPATH=. python kernels/engine_h200.py --out $OUT"}
    out = Path(args.out) / "engine_h200.json"
    d = Path(tempfile.mkdtemp())
    try:
        hf = make_checkpoint(d, "0.5B")
        for name, fn in (("correctness", lambda: correctness(hf, d, res)), ("decode_torch", lambda: decode_timing(d, res, "torch")),
                         ("decode_triton", lambda: decode_timing(d, res, "triton")),
                         ("hf_eager", lambda: hf_eager(hf, res))):
            try: fn()
            except Exception as e:
                import traceback; traceback.print_exc(); res[f"{name}_error"] = repr(e)
            out.write_text(json.dumps(res, indent=1))
    finally:
        out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "meta"}, indent=1))


if __name__ == "__main__":
    main()

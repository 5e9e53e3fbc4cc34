"""transformers as a yardstick on the GPU: nanoserve.yardsticks' two runners on the H200 (transformers 5.17 there).

Run on the device machine from the repo root:  PYTHONPATH=. python kernels/yardsticks_h200.py --out $OUT
Writes yardsticks_h200.json (raw numbers, git sha, GPU, versions, date) to --out; copy it to figures/data/.

1. correctness in fp32 on a few short requests: static-batch tokens and continuous-batching tokens against greedy
   decoding by full recomputation (the oracle), random weights of the Qwen2.5-0.5B shape.
2. timings in bf16 on lognormal requests (all arriving at 0): run_hf_static at a few batch sizes and
   run_hf_continuous, each after a warm-up of several seconds and each timed twice (flag > 15% disagreement).
`--smoke`: the same code on the CPU with a two-layer model of a tiny shape and a few requests, into a temp folder.
"""
import math, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))      # the only sys.path use in the lab
from lab import device_or_skip, is_smoke, parser, write   # first: --smoke must set the interpreter before torch loads

import torch

from nanoserve.yardsticks import load_hf_model, run_hf_continuous, run_hf_static

SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)


from nanoserve.measure import run_meta
SMOKE_SHAPE = dict(SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)


def make_checkpoint(path: Path, seed: int = 0, shape=SHAPE, device="cuda"):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device): hf = Qwen2ForCausalLM(Qwen2Config(**shape))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"): p.normal_(0, 0.02)
    hf.to(torch.bfloat16).save_pretrained(path)
    del hf
    if device == "cuda": torch.cuda.empty_cache()


def lognormal_requests(n, seed, prompt_median=256, out_median=128, sigma=0.8, cap=512, vocab_size=SHAPE["vocab_size"]):
    g = torch.Generator().manual_seed(seed)
    def draw(median): return int(min(cap, max(1, round(math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item())))))
    return [dict(prompt_token_ids=torch.randint(0, vocab_size, (draw(prompt_median),), generator=g).tolist(),
                 max_tokens=draw(out_median)) for _ in range(n)]


@torch.no_grad()
def oracle_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n): ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[-n:]


def summary(results, wall=None):
    e2e = sorted(r["e2e_s"] for r in results)
    ttft = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    q = lambda xs, p: xs[min(len(xs) - 1, int(math.ceil(p * len(xs))) - 1)] if xs else None
    toks = sum(r["num_output_tokens"] for r in results)
    return {"output_tokens": toks, "computed_tokens": sum(r["num_computed_tokens"] for r in results),
            "makespan_s": e2e[-1], "output_tok_per_s": toks / e2e[-1],
            "ttft_p50_s": q(ttft, 0.5), "ttft_p99_s": q(ttft, 0.99), "e2e_p50_s": q(e2e, 0.5), "e2e_p99_s": q(e2e, 0.99)}


def main():
    ap = parser(__doc__)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    args = ap.parse_args()
    dev, smoke = device_or_skip(args), is_smoke(args)
    if smoke: args.n, args.batch_sizes, args.warmup_s = 6, "4", 0.0
    shape = SMOKE_SHAPE if smoke else SHAPE
    res = {"meta": run_meta(), "shape": "tiny" if smoke else "0.5B", "n_requests": args.n}
    d = Path(tempfile.mkdtemp()) / "qwen2-0.5b-random"
    make_checkpoint(d, shape=shape, device=dev.type)

    # 1. fp32 correctness
    t = time.perf_counter()
    m32 = load_hf_model(d, dev.type, "float32")
    short = lognormal_requests(6, seed=1, prompt_median=24, out_median=12, cap=48, vocab_size=shape["vocab_size"])
    want = [oracle_greedy(m32, r["prompt_token_ids"], r["max_tokens"]) for r in short]
    st = run_hf_static(m32, short, 4)
    cb = run_hf_continuous(m32, short)
    res["fp32_check"] = {"requests": len(short), "tokens": sum(r["max_tokens"] for r in short),
                         "static_equal": sum(r["output_token_ids"] == w for r, w in zip(st, want)),
                         "continuous_equal": sum(r["output_token_ids"] == w for r, w in zip(cb, want)),
                         "counts_exact": all(r["num_output_tokens"] == len(r["output_token_ids"]) == q["max_tokens"]
                                             for q, rs in zip(short, (st, cb)) for r in rs),
                         "attn_after": m32.config._attn_implementation, "seconds": time.perf_counter() - t}
    print("fp32 check", res["fp32_check"], flush=True)
    write("yardsticks_h200.json", res, args)
    del m32
    if dev.type == "cuda": torch.cuda.empty_cache()

    # 2. bf16 timings
    model = load_hf_model(d, dev.type, "float32" if smoke else "bfloat16")
    reqs = lognormal_requests(args.n, seed=0, **(dict(prompt_median=16, out_median=8, cap=32) if smoke else {}),
                              vocab_size=shape["vocab_size"])
    res["requests"] = {"prompt_tokens": sum(len(r["prompt_token_ids"]) for r in reqs),
                       "max_tokens": sum(r["max_tokens"] for r in reqs),
                       "longest_prompt": max(len(r["prompt_token_ids"]) for r in reqs),
                       "longest_output": max(r["max_tokens"] for r in reqs)}
    rows = []
    runs = [("continuous", None)] + [("static", int(b)) for b in args.batch_sizes.split(",")]
    for kind, bs in runs:
        sums = []
        for rep in range(2):
            t = time.perf_counter()
            out = (run_hf_continuous(model, reqs, warmup_s=args.warmup_s) if kind == "continuous"
                   else run_hf_static(model, reqs, bs, warmup_s=args.warmup_s))
            s = summary(out); s["wall_s"] = time.perf_counter() - t
            assert all(r["num_output_tokens"] == len(r["output_token_ids"]) for r in out)
            sums.append(s)
            print(kind, bs, rep, {k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}, flush=True)
        tps = [s["output_tok_per_s"] for s in sums]
        rows.append({"runner": kind, "batch_size": bs, "runs": sums,
                     "disagree": abs(tps[0] - tps[1]) / max(tps) > 0.15})
        res["timings"] = rows
        write("yardsticks_h200.json", res, args)   # after every row: a run cut short still leaves what it measured
    print("done")


if __name__ == "__main__":
    main()

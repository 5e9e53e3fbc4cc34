"""nano-vllm's workload with decode-kernel variants (ids ahead, tiles, CUDA-core products) against the control.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/decode_ahead_h200.py --out $OUT

`decode_workload_h200.py --parts ahead` timed the decode kernel alone at the workload's decode steps: each tile's
block ids loaded a tile early (`KernelConfig.decode_ids_ahead`, `attend_rest`'s AHEAD=1) with tiles of 64 keys
(`decode_tile=64`) was the fastest of the variants, for the bf16 and the fp8 cache. This runs the whole workload
(Qwen3-0.6B's shape, random bf16 weights, 256 requests, prompt and output uniform in 100..1,024, greedy, EOS
ignored) on engines with and without it (`--variants`: also `decode_fma`, the products on the CUDA cores), for
each cache (`--caches`, default bf16 ("auto") and fp8). One engine
at a time fits beside the K/V cache, so the A/B is interleaved by engine: for each round, each variant in
alternating order is built, run once cold (compiles, captures), its prefix cache emptied, then timed once. The
greedy tokens of each variant are compared with the control's (bf16: they may differ where the attention's sums
round apart).

Writes decode_ahead_h200.json. `--smoke`: the built-in tiny model, 8 short requests, on the CPU.
"""
import sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, checkpoint, device_or_skip, disagree, drain, free, is_smoke, median, nanovllm_requests,  # noqa: E402
                 parser, run_parts, saver, sync, warm, write)

NAME = "decode_ahead_h200.json"
VARIANTS = {"control": {}, "ids ahead, tile 64": {"decode_ids_ahead": True, "decode_tile": 64},
            "fma, tile 64": {"decode_fma": True, "decode_tile": 64}}


def one_run(model_dir, cache: str, overrides: dict, smoke: bool) -> tuple[float, int, list]:
    "Build an engine, run the workload cold, empty the prefix cache, time one run: (seconds, tokens, token ids)."
    kw = dict(max_num_seqs=256, max_num_batched_tokens=16384, **({"num_kv_blocks": 512} if smoke else {}))
    llm = LLM(model_dir, kv_cache_dtype=cache, **kw, **overrides)
    reqs, sp = nanovllm_requests(llm.config.vocab_size, llm.max_model_len, smoke=smoke)
    prompts = [list(r.prompt_token_ids) for r in reqs]
    llm.generate(prompts, sp)                                  # cold: compiles, captures
    llm.reset_prefix_cache()
    warm(llm.device, 0.0 if smoke else 2.0)
    sync(llm.device); t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    sync(llm.device); seconds = time.perf_counter() - t0
    tokens = [list(o.token_ids) for o in outs]
    drain(llm); del llm; free()
    return seconds, sum(map(len, tokens)), tokens


def ab(res, args) -> None:
    smoke = is_smoke(args)
    device_or_skip(args)
    model_dir, shape = checkpoint("qwen3-0.6B", args)
    rounds = 1 if smoke else args.rounds
    for cache in args.caches.split(","):
        names = args.variants.split(";")
        secs, tokens, n = {v: [] for v in names}, {}, 0
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                s, n, tokens[name] = one_run(model_dir, cache, VARIANTS[name], smoke)
                secs[name].append(s)
                print(f"{cache} round {r} {name}: {n / s:,.0f} tok/s", flush=True)
                res.setdefault("runs", []).append({"cache": cache, "round": r, "variant": name, "seconds": s,
                                                   "output_tokens": n})
                write(NAME, res, args)                          # each run as it is measured
        res.setdefault("caches", {})[cache] = {
            "shape": shape, "output_tokens": n, "seconds": secs,
            "output_tokens_per_s": {v: [n / s for s in secs[v]] for v in names},
            "disagree": {v: disagree(min(secs[v]), max(secs[v])) for v in names},
            "speedup_over_control": {v: median(secs[names[0]]) / median(secs[v]) for v in names[1:]},
            "same_tokens_as_control": {v: tokens[names[0]] == tokens[v] for v in names[1:]}}
        print(cache, {k: v for k, v in res["caches"][cache].items() if k.endswith("control")}, flush=True)
        write(NAME, res, args)


def main():
    ap = parser(__doc__, parts="ab")
    ap.add_argument("--caches", default="auto,fp8", help="kv_cache_dtype values: auto (the model's), fp8, int8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="control;ids ahead, tile 64",
                    help="semicolon-separated names, the control first, of: " + "; ".join(VARIANTS))
    args = ap.parse_args()
    res = {"what": "nano-vllm's workload, decode block ids a tile ahead + 64-key tiles against the control",
           "variants": VARIANTS}
    run_parts({"ab": lambda: ab(res, args)}, args.parts, saver(NAME, res, args))


if __name__ == "__main__":
    main()

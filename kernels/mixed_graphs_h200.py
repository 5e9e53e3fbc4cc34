"""Mixed-step CUDA graphs on the H200 (the CUDA-graphs chapter's `MixedGraphs`; issues 5 and 6).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/mixed_graphs_h200.py --out $OUT [--parts check,steps,offline,nanovllm]
Writes mixed_graphs_h200.json (raw numbers, git sha, GPU, versions, date) to --out after every part; copy it to
figures/data/.

Random weights of the Qwen2.5-0.5B shape. Side by side in one run, `mixed_step_graphs=False` as the control
(decode graphs on in both):
1. check: the logits of one mixed step (decodes + a fresh prompt + a chunk after a cached prefix) replayed
   against the eager step, fp32 and bf16; greedy tokens with mixed graphs on and off on a run with arrivals
   (fp32 and bf16: identical sequences reported);
2. steps: ms per `LLM.step()` of a step that admits one prompt of P tokens next to b decodes, P in 16..2000,
   b in 1 and 32 (a warm-up before every row, timed twice, >15% disagreement flagged), and device kernels per
   step with the GPU's busy share from one profiled window of the same configuration;
3. offline: the benchmark chapter's lognormal workload (128 requests, the settings of kernels/bench_h200.sh),
   continuous batching with mixed graphs on and off and static batching at 32, each twice, each run in a fresh
   process (numerator: output tokens actually generated);
4. nanovllm: nano-vllm's workload (256 requests, uniform 100..1024 in and out, EOS ignored), twice.
"""
import argparse, json, os, random, statistics, sys, time
from pathlib import Path

import torch

from nanoserve.bench import WorkloadSpec, _spawn, make_workload, random_checkpoint
from nanoserve.engine import LLM, SamplingParams
from nanoserve.measure import busy_share, count_device_kernels, profile_run, run_meta, warm_gpu
from nanoserve.runner import eager_inputs

DISAGREE = 0.15


def mixed_step_logits(model_dir, dtype):
    "One scheduled mixed step run eagerly and replayed on the same cache: the sampled rows' logits."
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=2048, max_num_seqs=32, max_num_batched_tokens=2048)
    g = random.Random(0)
    ids = lambda n: [g.randrange(llm.config.vocab_size) for _ in range(n)]
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for n in (300, 17, 900, 64, 5):                    # five decoding sequences
        llm.add_request(ids(n), sp, stream=False)
    while any(r.seq.num_computed_tokens < r.seq.num_prompt_tokens for r in llm._requests.values()): llm.step()
    llm.add_request(ids(200), sp, stream=False)            # a fresh prompt that fits the step
    llm.add_request(ids(3000), sp, stream=False)           # a prompt the budget cuts: its chunk is not sampled
    step = llm.scheduler.schedule()
    runner = llm.runner
    sampling = [(0.0, 1.0, 0, 0, 0)] * sum(s.sample for s in step.seqs)
    before = runner.kv_cache.clone()
    with torch.inference_mode():
        mixed, runner.mixed_graphs = runner.mixed_graphs, None
        x = runner.pack(step, sampling)                      # the eager packing
        dev_i, _ = runner._to_device(x.ints, x.floats)
        i, p, meta, rows = eager_inputs(x, dev_i)
        eager = llm.model.compute_logits(llm.model(i, p, runner.kv_caches, meta)[rows]).clone()
        cache_eager = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        torch.cuda.synchronize()                             # the pinned staging buffer is about to be reused
        runner.mixed_graphs = mixed
        x = runner.pack(step, sampling)
        assert x.mixed_bucket is not None, "the step did not go to a mixed graph"
        dev_i, _ = runner._to_device(x.ints, x.floats)
        replay = mixed.run(dev_i[:x.num_step_ints], x.mixed_bucket, x.num_seqs, x.width)[:x.num_sampled].clone()
        torch.cuda.synchronize()
    rel = ((replay - eager).norm() / eager.norm()).item()
    cache_rel = ((runner.kv_cache.float() - cache_eager.float()).norm() / cache_eager.float().norm()).item()
    out = {"dtype": dtype, "num_tokens": step.num_tokens, "num_seqs": len(step.seqs), "bucket": x.mixed_bucket,
           "sampled_rows": x.num_sampled, "logits_rel_err": rel, "max_abs_diff": (replay - eager).abs().max().item(),
           "argmax_agree": (replay.argmax(-1) == eager.argmax(-1)).float().mean().item(), "cache_rel_err": cache_rel,
           "any_nan": bool(replay.isnan().any())}
    del llm, before, cache_eager; torch.cuda.empty_cache()
    return out


def greedy_with_arrivals(model_dir, dtype, mixed: bool, **kw):
    "Twelve prompts through 6 slots: later prompts are admitted while others decode (mixed steps)."
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=1024, max_num_seqs=6, max_num_batched_tokens=512,
              mixed_step_graphs=mixed, **kw)
    g = random.Random(3)
    prompts = [[g.randrange(llm.config.vocab_size) for _ in range(n)] for n in (7, 33, 64, 100, 130, 257, 9, 400, 50, 3, 77, 700)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (40, 8, 25, 48, 12, 30, 44, 9, 20, 36, 16, 24)]
    toks = [o.token_ids for o in llm.generate(prompts, params)]
    replays = (llm.runner.graphs.num_replays, llm.runner.mixed_graphs.num_replays if llm.runner.mixed_graphs else 0)
    del llm; torch.cuda.empty_cache()
    return toks, replays


def check(model_dir, res):
    res["logits"] = [mixed_step_logits(model_dir, d) for d in ("float32", "bfloat16")]
    for r in res["logits"]: print("logits", r, flush=True)
    par = {}
    for dtype in ("float32", "bfloat16"):
        (off, r_off), (on, r_on) = greedy_with_arrivals(model_dir, dtype, False), greedy_with_arrivals(model_dir, dtype, True)
        pos = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), len(a)) for a, b in zip(off, on)]
        par[dtype] = {"sequences": len(off), "identical": sum(a == b for a, b in zip(off, on)), "agreeing_prefixes": pos,
                      "lengths": [len(a) for a in off], "replays_off": r_off, "replays_on": r_on}
        print("parity", dtype, par[dtype], flush=True)
    res["greedy_parity"] = par


def timed_admissions(llm, num_decodes, prompt_len, reps, g):
    "ms of each step that admits one `prompt_len`-token prompt (max_tokens=1) next to `num_decodes` decodes."
    out = []
    for _ in range(reps):
        llm.add_request([g.randrange(llm.config.vocab_size) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=1, ignore_eos=True), stream=False)
        t0 = time.perf_counter()
        llm.step()
        out.append((time.perf_counter() - t0) * 1e3)
        llm.step()                                   # one decode-only step between admissions
    return out


def steps(model_dir, res):
    from graphs_h200 import steady_decode
    rows = []
    for mixed in (False, True):
        llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=16384, max_num_seqs=64, max_num_batched_tokens=2048,
                  mixed_step_graphs=mixed)
        g = random.Random(5)
        for b in (1, 32):
            for P in (16, 128, 512, 2000):
                steady_decode(llm, b, prompt_len=256)
                warm_gpu(1.0, llm.device)
                timed_admissions(llm, b, P, 3, g)                  # warm-up of this shape
                t1 = timed_admissions(llm, b, P, 10, g)
                t2 = timed_admissions(llm, b, P, 10, g)
                m1, m2 = statistics.median(t1), statistics.median(t2)
                row = {"mixed_graphs": mixed, "decodes": b, "prompt_len": P, "ms_per_step": [m1, m2],
                       "median_ms": statistics.median(t1 + t2), "disagree": abs(m1 - m2) > DISAGREE * min(m1, m2)}
                if P == 128:                                        # kernels and busy share of admission steps
                    with profile_run(llm.device) as run:
                        timed_admissions(llm, b, P, 4, g)
                    row["kernels_per_admission_pair"] = count_device_kernels(run.events) / 4
                    row["gpu_busy"] = busy_share(run)
                print("step", row, flush=True)
                rows.append(row)
        if mixed: res["mixed_graph_capture"] = {"seconds": llm.runner.mixed_graphs.capture_s,
                                                "memory_mib": llm.runner.mixed_graphs.memory_bytes / 2**20,
                                                "buckets": llm.runner.mixed_graphs.token_sizes,
                                                "decode_capture_s": llm.runner.graphs.capture_s}
        for i in list(llm._requests): llm.abort_request(i)
        del llm; torch.cuda.empty_cache()
    res["admission_steps"] = rows


OFFLINE_CONFIGS = [("continuous", "continuous", {}),
                   ("continuous, mixed steps eager", "continuous", {"mixed_step_graphs": False}),
                   ("static:32", "static:32", {})]
OFFLINE_COMMON = dict(dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=2048, num_kv_blocks=8192)


def offline(model_dir, res, repeats=2, configs=OFFLINE_CONFIGS, common=OFFLINE_COMMON):
    spec = WorkloadSpec(kind="lognormal", num_requests=128, prompt_median=256, output_median=128, prompt_max=1024,
                        output_max=512)
    reqs = make_workload(spec, 151936, 32768)
    rows = []
    for name, engine, extra in configs:
        reps = []
        for _ in range(repeats):
            job = {"engine": engine, "model_dir": str(model_dir), "send_times": None,
                   "requests": [[list(r.prompt_token_ids), r.max_tokens] for r in reqs],
                   "engine_kwargs": common | extra, "warmup_s": 3.0, "progress": False, "profile_steps": 0}
            t0 = time.perf_counter()
            r = _spawn(job, 400)
            s = r["summary"]
            reps.append({"summary": s, "ledger": r.get("ledger"), "ledger_decode": r.get("ledger_decode"),
                         "preemptions": r.get("preemptions"),
                         "process_s": time.perf_counter() - t0})
            print("offline", name, {k: s[k] for k in ("output_tokens_per_s", "num_output_tokens") if k in s},
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        tps = [x["summary"]["output_tokens_per_s"] for x in reps]
        rows.append({"config": name, "engine": engine, "engine_kwargs": common | extra, "output_tokens_per_s": tps,
                     "disagree": max(tps) - min(tps) > DISAGREE * min(tps), "reps": reps})
        res["offline"] = {"workload": spec.__dict__, "numerator": "output tokens actually generated", "rows": rows}


def nanovllm(model_dir, res, repeats=2):
    from graphs_h200 import nanovllm_requests, timed_generate
    reqs, sp = nanovllm_requests()
    llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=16384)
    n, times, _ = timed_generate(llm, reqs, sp, repeats, "graphs")
    res["nanovllm"] = {"output_tokens": n, "seconds": times, "output_tokens_per_s": [n / t for t in times],
                       "disagree": abs(times[0] - times[-1]) > DISAGREE * min(times),
                       "mixed_replays": llm.runner.mixed_graphs.num_replays, "decode_replays": llm.runner.graphs.num_replays,
                       "num_kv_blocks": llm.num_kv_blocks, "max_num_seqs": 256, "max_num_batched_tokens": 16384}
    del llm; torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="check,steps,offline,nanovllm")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    res = {"meta": run_meta(), "command": f"PYTHONPATH=. python kernels/mixed_graphs_h200.py --parts {args.parts}"}
    out = Path(args.out) / "mixed_graphs_h200.json"
    d05 = random_checkpoint("0.5B")
    parts = {"check": lambda: check(d05, res), "steps": lambda: steps(d05, res), "offline": lambda: offline(d05, res),
             "nanovllm": lambda: nanovllm(d05, res)}
    from graphs_h200 import run_parts
    run_parts(parts, args.parts, res, out)


if __name__ == "__main__":
    main()

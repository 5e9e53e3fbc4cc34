"""Async scheduling on the H200: the host schedules and packs step N+1 while the GPU runs step N (issue 6's overlap).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/async_h200.py --out $OUT [--parts parity,decode,7b,offline,nanovllm]
Writes async_h200.json (raw numbers, git sha, GPU, versions, date) to --out after every part; copy it to
figures/data/.

Random weights of the Qwen2.5 shapes, bf16, CUDA graphs (decode and mixed steps) and fused kernels on; side by
side in one run with `async_scheduling=False` as the control:
1. parity: greedy tokens async against sync on a run with arrivals (fp32 must be identical; bf16 reported);
2. decode: ms per `LLM.step()` in steady decode of the 0.5B shape at batch 1, 8, 64, 256 (warm-up before every row,
   timed twice, >15% disagreement flagged), device kernels per step and GPU busy share from one profiled window
   of the same configuration, the step ledger, and the memory floor (copy bandwidth measured in the same run);
3. 7b: the same at batch 1 and 8 for the 7B shape;
4. offline: the benchmark chapter's lognormal workload (128 requests, kernels/bench_h200.sh's settings),
   continuous and static:32, async and sync, each twice, each run in a fresh process;
5. nanovllm: nano-vllm's workload (256 requests, uniform 100..1024 in and out, EOS ignored), async, twice.
"""
import json, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import graphs_h200 as G                                      # noqa: E402  (steady-decode rows, floors, 7B weights)
import mixed_graphs_h200 as M                                # noqa: E402  (offline runs, nano-vllm workload)
from nanoserve.bench import random_checkpoint                # noqa: E402

CONFIGS = {"sync": dict(fused_kernels=True, async_scheduling=False),      # name -> LLM keyword overrides
           "async": dict(fused_kernels=True, async_scheduling=True)}


def parity(model_dir, res):
    out = {}
    for dtype in ("float32", "bfloat16"):
        toks = {}
        for name, flag in (("sync", False), ("async", True)):
            toks[name], _ = M.greedy_with_arrivals(model_dir, dtype, True, async_scheduling=flag)
        a, b = toks["sync"], toks["async"]
        out[dtype] = {"sequences": len(a), "identical": sum(x == y for x, y in zip(a, b)),
                      "agreeing_prefixes": [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
                                            for x, y in zip(a, b)], "lengths": [len(x) for x in a]}
        print("parity", dtype, out[dtype], flush=True)
    res["greedy_parity"] = out


def step_rate(model_dir, res, shape, batches, num_steps=200):
    "Steps per second, sync against async (graphs_h200.step_rates), into res['step_rate']."
    G.step_rates(model_dir, res, shape, batches, list(CONFIGS.items()), "step_rate",
                 num_steps, warm_s=1.5)


def kernel_names(model_dir, res, batches=(1, 64), steps=16):
    "Device kernels of steady decode steps (async, graphs, fused) grouped by name: which ones a step is made of."
    from collections import Counter
    from nanoserve.measure import event_record, is_device_kernel, profile_run, warm_gpu
    llm = G.LLM(model_dir, dtype="bfloat16", num_kv_blocks=16384, max_num_seqs=max(batches), **CONFIGS["async"])
    out = {}
    for b in batches:
        G.steady_decode(llm, b)
        warm_gpu(1.0, llm.device)
        for _ in range(20): llm.step()
        with profile_run(llm.device) as run:
            for _ in range(steps): llm.step()
            torch.cuda.synchronize()
        names = Counter(event_record(e)["name"][:90] for e in run.events if is_device_kernel(e))
        out[b] = {"kernels_per_step": sum(names.values()) / steps,
                  "by_name": {k: v / steps for k, v in names.most_common()}}
        print("kernels", b, out[b]["kernels_per_step"], list(out[b]["by_name"].items())[:14], flush=True)
    for i in list(llm._requests): llm.abort_request(i)
    while llm._inflight is not None: llm.step()
    res["kernel_names"] = out
    del llm; torch.cuda.empty_cache()


def main():
    args, res, out = G.script_args("async_h200", "parity,decode,7b,offline,nanovllm")
    d05 = random_checkpoint("0.5B")
    common = dict(dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=2048, num_kv_blocks=8192)
    parts = {
        "parity": lambda: parity(d05, res),
        "decode": lambda: G.decode_rows(d05, res, "0.5B", CONFIGS, [1, 8, 64, 256], "decode", 30),
        "7b": lambda: G.decode_rows(G.fast_random_checkpoint("7B"), res, "7B", CONFIGS, [1, 8], "decode", 20),
        "offline": lambda: M.offline(d05, res, configs=[
            ("continuous, async", "continuous", {"async_scheduling": True}),
            ("static:32, async", "static:32", {"async_scheduling": True}),
            ("continuous, sync", "continuous", {"async_scheduling": False}),
            ("static:32, sync", "static:32", {"async_scheduling": False})], common=common),
        "offline-async": lambda: M.offline(d05, res, configs=[
            ("continuous, async", "continuous", {"async_scheduling": True}),
            ("static:32, async", "static:32", {"async_scheduling": True})], common=common),
        "nanovllm": lambda: M.nanovllm(d05, res, repeats=3),
        "rate": lambda: step_rate(d05, res, "0.5B", [1, 8, 64, 256]),
        "kernels": lambda: kernel_names(d05, res),
        "rate7b": lambda: step_rate(G.fast_random_checkpoint("7B"), res, "7B", [1]),
    }
    G.run_parts(parts, args.parts, res, out)
    try: G.floors(res, None)
    except Exception as e: res["floors_error"] = repr(e)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

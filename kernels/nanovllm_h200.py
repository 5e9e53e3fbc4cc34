"""nano-vllm's workload (256 requests, prompt and output lengths uniform in 100..1024, greedy, EOS ignored) on one
engine, with a per-step ledger of where the time went: the host's phases, the wait for the GPU, the GPU's own span.

    PYTHONPATH=<tree> python kernels/nanovllm_h200.py --model DIR --label NAME --out FILE.json [--repeats 2]
        [--freeze-gc] [--keep-prefix-cache] [--host-model TINY_DIR]

Written to run against any checkout of the package (PYTHONPATH picks the tree), so that two versions of the code
can be compared on one machine, in alternating processes. Each process: build the engine (default KV sizing),
one cold run (compiles, captures: flagged, not compared), then `--repeats` warm runs without the ledger and one with
it, the prefix cache emptied before each (else a rerun finds every prompt cached and skips prefill). Each run
records its GC time and a hash of its output tokens (the same in every tree: greedy). With `--host-model`, also
the host alone: the whole workload through a CPU engine whose runner returns at once (`host_generate`), and the
per-step host path at batch 64 and 256: how fast this machine's host is, and the most it lets the engine reach.
"""
import argparse, gc, hashlib, json, random, sys, time, timeit
from pathlib import Path

import torch

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

from nanoserve.bench import WorkloadSpec, make_workload, run_meta
from nanoserve.engine import LLM, SamplingParams, StepLedger
from nanoserve.measure import warm_gpu


def requests(llm, num_requests=256):
    reqs = make_workload(WorkloadSpec(kind="nanovllm", num_requests=num_requests, seed=0), llm.config.vocab_size,
                         32768)
    return ([list(r.prompt_token_ids) for r in reqs],
            [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs])


class GcClock:
    "Seconds spent in the garbage collector while attached (gc.callbacks)."
    def __init__(self): self.seconds, self.collections, self._t = 0.0, [0, 0, 0], None
    def __call__(self, phase, info):
        if phase == "start": self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t; self.collections[info["generation"]] += 1


def run_once(llm, prompts, sp, ledger: bool, keep_prefix_cache: bool = False):
    """One timed `generate` of the workload. Unless `keep_prefix_cache`, the prefix cache is emptied first, so the
    run computes every prompt (a rerun of the same prompts would otherwise find them cached and skip prefill)."""
    if not keep_prefix_cache: llm.block_manager.reset_prefix_cache()
    clock = GcClock(); gc.callbacks.append(clock)
    llm.ledger = StepLedger() if ledger else None
    llm._last_step_end = None              # the first step's gap is not the warm-up
    warm_gpu(3.0, llm.device)
    sync(); t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    sync(); dt = time.perf_counter() - t0
    gc.callbacks.remove(clock)
    n = sum(len(o.token_ids) for o in outs)
    digest = hashlib.sha1(json.dumps([o.token_ids for o in outs]).encode()).hexdigest()[:16]
    row = {"seconds": dt, "output_tokens": n, "output_tokens_per_s": n / dt, "ledger": ledger, "tokens_sha1": digest,
           "gc_seconds": clock.seconds, "gc_collections": clock.collections,
           "preemptions": sum(o.num_preemptions for o in outs)}
    if ledger:
        rows, row["ledger_summary"] = llm.ledger.rows, {}
        for name, pick in (("decode", lambda r: r["decode_only"]), ("other", lambda r: not r["decode_only"]),
                           ("decode_b>=192", lambda r: r["decode_only"] and r["num_seqs"] >= 192),
                           ("decode_b64-191", lambda r: r["decode_only"] and 64 <= r["num_seqs"] < 192),
                           ("decode_b<64", lambda r: r["decode_only"] and r["num_seqs"] < 64)):
            sel = [r for r in rows if pick(r)]
            if not sel: continue
            s = {k: sum(r.get(k, 0.0) for r in sel) for k in
                 ("gap", "schedule", "prepare", "h2d", "launch", "sync", "update", "gpu", "total")}
            s["host"] = s["total"] - s["sync"]
            s.update(steps=len(sel), seqs=sum(r["num_seqs"] for r in sel), tokens=sum(r["num_tokens"] for r in sel))
            row["ledger_summary"][name] = s
        llm.ledger = None
    print(json.dumps({k: v for k, v in row.items() if k != "ledger_summary"}), flush=True)
    if ledger:
        for k, v in row["ledger_summary"].items():
            print(" ", k, {a: (round(b * 1e3 / v["steps"], 3) if isinstance(b, float) else b) for a, b in v.items()},
                  "(ms a step)", flush=True)
    return row


def host_path(llm_dir, batch):
    """ms a step of the host path alone at `batch` (1,000-token prompts, graph-bucket packing, no GPU work)."""
    from host_path import decoding_engine
    llm, one = decoding_engine(llm_dir, batch)
    one()
    out = [timeit.timeit(one, number=50) / 50 * 1e3 for _ in range(3)]
    del llm
    return out


def host_generate(llm_dir, repeats=3):
    """nano-vllm's workload through the engine's whole host path with the GPU's work taken out: a CPU engine with
    async scheduling and decode steps packed for the CUDA-graph buckets, whose runner returns token 1 for every
    sampled row at once. Output tokens a second of the host alone: the most the host lets the engine reach."""
    llm = LLM(llm_dir, max_num_seqs=256, max_num_batched_tokens=16384, num_kv_blocks=40000, device="cpu",
              async_scheduling=True)
    llm.runner.enable_graphs([1, 2, 4, 8, 16, 32, 64, 128, 256], llm.max_model_len, capture=False)

    def wait(launched, row=None):
        if row is not None: row.update(sync=0.0, gpu=0.0)
        return launched[0]
    llm.runner.launch = lambda x, row=None: ([1] * x.num_sampled, None, None, 0.0)
    llm.runner.wait = wait
    g = random.Random(0)
    prompts = [[g.randrange(llm.config.vocab_size) for _ in range(g.randrange(100, 1025))] for _ in range(256)]
    sp = [SamplingParams(max_tokens=g.randrange(100, 1025), temperature=0, ignore_eos=True) for _ in range(256)]
    out = []
    gc.collect(); gc.freeze()             # as the engine's `freeze_gc` does (not in the old trees)
    for _ in range(repeats):
        llm.block_manager.reset_prefix_cache()
        t0 = time.perf_counter(); outs = llm.generate(prompts, sp); dt = time.perf_counter() - t0
        out.append(sum(len(o.token_ids) for o in outs) / dt)
    gc.unfreeze()
    del llm
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--freeze-gc", action="store_true", help="gc.collect() + gc.freeze() after the engine is built")
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="do not empty the prefix cache between runs (reruns then skip most of prefill)")
    ap.add_argument("--num-requests", type=int, default=256, help="fewer for a CPU smoke test")
    ap.add_argument("--host-model", default=None, help="a small checkpoint for the host-path timing (CPU)")
    args = ap.parse_args()
    res = {"label": args.label, "meta": run_meta(), "package": str(Path(sys.modules["nanoserve"].__file__).parent),
           "command": "PYTHONPATH=<tree> python kernels/nanovllm_h200.py " + " ".join(sys.argv[1:]),
           "workload": "256 requests, prompt and output uniform 100..1024, greedy, EOS ignored, seed 0",
           "numerator": "output tokens actually generated"}
    if args.host_model:
        res["host_generate_tok_s"] = host_generate(args.host_model)
        print("host-only generate, tok/s", [round(x) for x in res["host_generate_tok_s"]], flush=True)
        for b in (64, 256):
            res[f"host_path_b{b}_ms"] = host_path(args.host_model, b)
            print("host path", b, [round(x, 3) for x in res[f"host_path_b{b}_ms"]], flush=True)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=16384)
    res["build_seconds"], res["num_kv_blocks"] = time.perf_counter() - t0, llm.num_kv_blocks
    res["freeze_gc"], res["keep_prefix_cache"] = args.freeze_gc, args.keep_prefix_cache
    if args.freeze_gc:
        gc.collect(); gc.freeze()
        res["gc_frozen_objects"] = gc.get_freeze_count()
    prompts, sp = requests(llm, args.num_requests)
    llm.generate([p[:32] for p in prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True))
    keep = args.keep_prefix_cache
    res["runs"] = [dict(run_once(llm, prompts, sp, False, keep), cold=True)]
    res["runs"] += [run_once(llm, prompts, sp, False, keep) for _ in range(args.repeats)]
    res["runs"].append(run_once(llm, prompts, sp, True, keep))
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

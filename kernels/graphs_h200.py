"""CUDA graphs and the overhead diet on the GPU (issue: CUDA graphs and the overhead diet).

Run on the device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/graphs_h200.py --out $OUT
Writes graphs_h200.json (raw numbers, git sha, GPU, versions, date) to --out; copy it to figures/data/.

With random weights of the Qwen2.5 shapes (`nanoserve.model.SHAPES`), side by side in one run, `enforce_eager` as the control:
1. greedy tokens with graphs on and off (fp32, where they must be identical; bf16, agreement reported), at a
   batch that pads (6 sequences in the 8 bucket) and at batch 1;
2. decode steps of the 0.5B shape in bf16 for each configuration (eager, eager + fused kernels, graphs,
   graphs + fused kernels) at several batch sizes: ms per `LLM.step()` (warm-up before every row, timed twice,
   >15% disagreement flagged), device kernels per step and GPU busy share from one profiled window of the same
   configuration (device kernels only), and the step ledger (where the host time goes);
3. the 7B shape at batch 1 with graphs + fused kernels against eager, and against its memory floor (weight
   bytes + K/V bytes over the copy bandwidth measured in the same run);
4. nano-vllm's workload (256 requests, prompt and output lengths uniform in 100..1024, EOS ignored): output
   tokens/s with graphs and without (numerator: generated tokens).
"""
import argparse, json, os, random, sys, tempfile, time
from pathlib import Path

import torch

from nanoserve.bench import WorkloadSpec, make_workload, random_checkpoint
from nanoserve.engine import LLM, SamplingParams, StepLedger
from nanoserve.measure import (busy_share, count_device_kernels, decode_floor_ms, kv_bytes_per_token,
                               model_weight_bytes, profile_run, run_meta, time_twice, warm_gpu)
from nanoserve.model import SHAPES

CONFIGS = {"eager": dict(enforce_eager=True), "eager+fused": dict(enforce_eager=True, fused_kernels=True),
           "graphs": dict(), "graphs+fused": dict(fused_kernels=True)}      # name -> LLM keyword overrides


def greedy_parity(model_dir, res):
    "Graphs on vs off: the same greedy tokens (fp32 must be identical)."
    g = random.Random(3)
    prompts = [[g.randrange(151936) for _ in range(n)] for n in (7, 33, 64, 100, 130, 257)]
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    out = {}
    for dtype in ("float32", "bfloat16"):
        toks = {}
        for name, kw in (("eager", dict(enforce_eager=True)), ("graphs", {})):
            llm = LLM(model_dir, dtype=dtype, num_kv_blocks=1024, max_num_seqs=8, **kw)
            toks[name] = {"batch6": [o.token_ids for o in llm.generate(prompts, sp)],
                          "batch1": llm.generate(prompts[0], sp)[0].token_ids}
            if name == "graphs": replays = llm.runner.graphs.num_replays
            del llm; torch.cuda.empty_cache()
        same = sum(a == b for x in ("batch6",) for a, b in zip(toks["eager"][x], toks["graphs"][x]))
        pos = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), len(a))
               for a, b in zip(toks["eager"]["batch6"], toks["graphs"]["batch6"])]
        out[dtype] = {"sequences": len(prompts), "identical_sequences": same, "agreeing_prefixes": pos,
                      "batch1_identical": toks["eager"]["batch1"] == toks["graphs"]["batch1"], "graph_replays": replays}
        print("parity", dtype, out[dtype], flush=True)
    res["greedy_parity"] = out


def steady_decode(llm, batch, prompt_len=128, seed=0):
    "Abort everything, add `batch` requests and run their prefill: decode-only steps from here."
    for i in list(llm._requests): llm.abort_request(i)
    g = random.Random(seed)
    for _ in range(batch):
        llm.add_request([g.randrange(llm.config.vocab_size) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=min(4000, llm.max_model_len - prompt_len), temperature=0, ignore_eos=True), stream=False)
    while any(r.seq.num_computed_tokens < r.seq.num_prompt_tokens for r in llm._requests.values()): llm.step()


def decode_rows(model_dir, res, shape, configs: dict, batches, key, repeats=40):
    "Steady decode rows (rate, profiled kernels and busy share, ledger) of each configuration (name -> LLM overrides)."
    for cname, kw in configs.items():
        llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=32768 if shape == "0.5B" else 8192, max_num_seqs=max(batches),
                  max_num_batched_tokens=max(2048, max(batches)), show_progress=False, **kw)
        for b in batches:
            steady_decode(llm, b)
            warm_gpu(2.0, llm.device)
            t = time_twice(llm.step, warmup_s=0.3, repeats=repeats)
            ctx = sum(r.seq.num_prompt_tokens + len(r.seq.output_token_ids) for r in llm._requests.values()) / b
            steady_decode(llm, b, seed=1)
            llm.ledger = StepLedger()
            for _ in range(32): llm.step()
            ledger = llm.ledger.summary(decode_only=True); llm.ledger = None
            steps = 16
            with profile_run(llm.device) as run:
                for _ in range(steps): llm.step()
            row = {"shape": shape, "config": cname, "batch": b, "ms_per_step": [t.first_ms, t.second_ms], "mean_context": ctx,
                   "median_ms": t.median_ms, "disagree": t.disagree, "tokens_per_s": b / (t.median_ms / 1e3),
                   "kernels_per_step": count_device_kernels(run.events) / steps, "gpu_busy": busy_share(run),
                   "profiled_ms_per_step": run.wall_s / steps * 1e3, "ledger_decode": ledger,
                   "graph_capture_s": llm.runner.graphs.capture_s if llm.runner.graphs else None,
                   "graph_memory_mib": llm.runner.graphs.memory_bytes / 2**20 if llm.runner.graphs else None}
            print(key, {k: v for k, v in row.items() if k != "ledger_decode"}, flush=True)
            res.setdefault(key, []).append(row)
        for i in list(llm._requests): llm.abort_request(i)
        del llm; torch.cuda.empty_cache()


def copy_bandwidth_GBps(nbytes=4 << 30):
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda"); y = torch.empty_like(x)
    t = time_twice(lambda: y.copy_(x), warmup_s=1.0, repeats=10)
    del x, y; torch.cuda.empty_cache()
    return 2 * nbytes / (t.median_ms / 1e3) / 1e9, t.disagree


def copies_for_l2(nbytes: int) -> int:
    "Operand copies that make graph_bench's calls read >= 256 MB (five times L2): no call finds its weights cached."
    return max(1, min(32, -(-(256 << 20) // max(nbytes, 1))))


def operand_copies(tensors, nbytes: int) -> list[tuple]:
    "The operands (a tuple; None stays None) and clones of them, `copies_for_l2(nbytes)` in all."
    return [tuple(tensors)] + [tuple(None if t is None else t.clone() for t in tensors)
                               for _ in range(copies_for_l2(nbytes) - 1)]


def graph_bench(make_call, nbytes: int, passes: int = 2, replays: int = 10) -> list[float]:
    """Microseconds per call of `make_call(i)()` as a decode step sees it: calls over R copies of the operands
    (R x nbytes >= 256 MB, five times L2, so no call finds its weights cached) captured in one CUDA graph, the
    graph replayed `replays` times per pass; one value per pass (no host launch time, no cache flush kernel)."""
    R = copies_for_l2(nbytes)
    calls = [make_call(i) for i in range(R)]
    for c in calls: c()                               # compile, pick algorithms, make the split counters
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls: c()
    g.replay(); torch.cuda.synchronize()
    out = []
    for _ in range(passes):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays): g.replay()
        b.record(); b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / (replays * R))
    del g
    return out


def step_rates(model_dir, res, shape, batches, configs, key, steps=200, warm_s=1.0):
    """ms per step over `steps` consecutive `LLM.step()` calls with one sync per pass (a per-call sync would drain
    the pipeline async scheduling builds), a warm-up pass then two timed passes, per (name, LLM kwargs) config;
    rows appended to res[key]."""
    from nanoserve.measure import warm_gpu
    rows = res.setdefault(key, [])
    for cname, kw in configs:
        llm = LLM(model_dir, dtype="bfloat16", num_kv_blocks=16384 if shape == "0.5B" else 4096,
                  max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches)), **kw)
        for b in batches:
            steady_decode(llm, b)
            warm_gpu(warm_s, llm.device)
            times = []
            for _ in range(3):
                torch.cuda.synchronize(); t0 = time.perf_counter()
                for _ in range(steps): llm.step()
                torch.cuda.synchronize(); times.append((time.perf_counter() - t0) / steps * 1e3)
            row = {"shape": shape, "config": cname, "batch": b, "ms_per_step": times[1:], "warmup_ms": times[0],
                   "best_ms": min(times[1:]), "disagree": abs(times[1] - times[2]) > 0.15 * min(times[1:])}
            print("rate", row, flush=True)
            rows.append(row)
        for i in list(llm._requests): llm.abort_request(i)
        while llm._inflight is not None: llm.step()
        del llm; torch.cuda.empty_cache()


def fast_random_checkpoint(shape):
    "A config-only folder; the loader is pointed at random tensors made on the GPU (a 7B safetensors file is 15 GB)."
    import nanoserve.model as M
    from nanoserve.tokenizer import ensure_default_model, qwen2_weight_shapes
    import shutil
    d = Path(tempfile.mkdtemp())
    cfg = {"model_type": "qwen2", **SHAPES[shape], "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "dtype": "bfloat16", "rope_theta": 1e6, "use_sliding_window": False}
    (d / "config.json").write_text(json.dumps(cfg))
    for f in ensure_default_model().iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json": shutil.copy(f, d / f.name)
    real = M.load_state_dict
    def fake(model_dir, device="cpu"):
        if Path(model_dir) != d: return real(model_dir, device)
        gen = torch.Generator(device="cuda").manual_seed(0)
        return {n: torch.ones(s, device="cuda", dtype=torch.bfloat16) if n.endswith("norm.weight") else
                torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                for n, s in qwen2_weight_shapes(cfg).items()}
    M.load_state_dict = fake
    return d


def floors(res, shapes):
    bw, dis = copy_bandwidth_GBps()
    res["copy_bandwidth_GBps"], res["copy_bandwidth_disagree"] = bw, dis
    for row in res.get("decode", []):
        cfg = SHAPES[row["shape"]]
        fl = decode_floor_ms(model_weight_bytes(cfg), row["batch"] * row["mean_context"] * kv_bytes_per_token(cfg), bw)
        row["floor_ms"], row["x_floor"] = fl, row["median_ms"] / fl


def nanovllm_requests():
    "nano-vllm's workload: 256 requests, prompt and output lengths uniform in 100..1024, EOS ignored."
    reqs = make_workload(WorkloadSpec(kind="nanovllm", num_requests=256, seed=0), 151936, 32768)
    return reqs, [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]


def timed_generate(llm, reqs, sp, repeats, label):
    "Warm the GPU, then time `generate` on all `reqs` `repeats` times: (tokens generated, seconds per run, outputs)."
    llm.generate([list(r.prompt_token_ids[:32]) for r in reqs[:8]], SamplingParams(max_tokens=8, ignore_eos=True))
    times = []
    for _ in range(repeats):
        warm_gpu(3.0, llm.device)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        outs = llm.generate([list(r.prompt_token_ids) for r in reqs], sp)
        torch.cuda.synchronize(); dt = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        assert n == sum(r.max_tokens for r in reqs)
        times.append(dt)
        print("nanovllm", label, n, f"{dt:.2f} s", f"{n / dt:,.0f} tok/s", flush=True)
    return n, times, outs


def nanovllm_workload(model_dir, res, repeats=2):
    reqs, sp = nanovllm_requests()
    rows = []
    for cname in ("graphs+fused", "eager"):
        llm = LLM(model_dir, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=16384, **CONFIGS[cname])
        n, times, outs = timed_generate(llm, reqs, sp, repeats if cname != "eager" else 1, cname)
        rows.append({"config": cname, "output_tokens": n, "seconds": times, "output_tokens_per_s": n / min(times),
                     "disagree": len(times) > 1 and abs(times[0] - times[1]) / min(times) > 0.15,
                     "preemptions": sum(o.num_preemptions for o in outs), "num_kv_blocks": llm.num_kv_blocks})
        del llm; torch.cuda.empty_cache()
    res["nanovllm"] = {"workload": {"num_requests": 256, "prompt_len": "uniform 100..1024", "output_len": "uniform 100..1024",
                                    "ignore_eos": True, "seed": 0, "max_num_seqs": 256, "max_num_batched_tokens": 16384},
                       "numerator": "output tokens actually generated", "rows": rows}


def run_parts(parts: dict, names: str, res: dict, out: Path) -> None:
    "Run the comma-separated `names` of `parts` in order; a failing part is recorded, and `res` is written after each."
    for name in names.split(","):
        t0 = time.perf_counter()
        try: parts[name]()
        except Exception as e:
            import traceback; traceback.print_exc(); res[f"{name}_error"] = repr(e)
        res.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
        print(f"part {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        out.write_text(json.dumps(res, indent=1))


def script_args(script: str, default_parts: str):
    """The `--out` and `--parts` arguments a kernels/ script takes; its result dict (run metadata, the command) and
    the path of its JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default=default_parts)
    args = ap.parse_args()
    res = {"meta": run_meta(), "command": f"PYTHONPATH=. python kernels/{script}.py --parts {args.parts}"}
    return args, res, Path(args.out) / f"{script}.json"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="parity,decode,7b,nanovllm")
    args = ap.parse_args()
    res = {"meta": run_meta(), "command": "PYTHONPATH=. python kernels/graphs_h200.py --out $OUT", "dtype": "bfloat16"}
    out = Path(args.out) / "graphs_h200.json"
    d05 = random_checkpoint("0.5B")
    parts = {
        "parity": lambda: greedy_parity(d05, res),
        "decode": lambda: decode_rows(d05, res, "0.5B", CONFIGS, [1, 8, 64, 256], "decode"),
        "7b": lambda: decode_rows(fast_random_checkpoint("7B"), res, "7B",
                                  {c: CONFIGS[c] for c in ("eager", "graphs+fused")}, [1, 8], "decode", 20),
        "nanovllm": lambda: nanovllm_workload(d05, res),
    }
    run_parts(parts, args.parts, res, out)
    try: floors(res, None)
    except Exception as e: res["floors_error"] = repr(e)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Tensor parallelism on two H200s (issue: tensor parallelism over NCCL).

Run on the nvidia-h200-x2 device machine from the repo root:
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/tp_h200.py --out $OUT
Writes tp_h200.json (raw numbers, git sha, GPUs, versions, date) to --out; copy it to figures/data/.

Random weights of the Qwen2.5-7B shape in bf16 (written once as a safetensors folder, generated on the GPU),
`tensor_parallel_size` 1 and 2 side by side in one run, CUDA graphs on (and TP=2 eager as a control):
1. greedy tokens of TP=2 against TP=1 (bf16: agreement reported; random weights make near-ties);
2. decode step at batch 1 and 8: ms per `LLM.step()` (GPU warmed before every row, timed twice, >15% flagged),
   and from one profiled window on rank 0 (device kernels only): kernels per step, GPU busy share, and the share
   of the window spent in NCCL kernels (all-reduce and all-gather; it includes waiting for the other rank);
3. offline throughput on the lognormal workload (128 requests, prompt median 256, output median 128, EOS
   ignored; numerator: generated tokens), twice per configuration.
"""
import argparse, json, os, random, sys, time
from pathlib import Path

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)          # never NVLink multicast on the lent machines

import torch

from nanoserve.bench import SHAPES, WorkloadSpec, make_workload, run_meta
from nanoserve.engine import LLM, SamplingParams
from graphs_h200 import steady_decode     # kernels/ is on sys.path when run as a script
from nanoserve.measure import busy_share, count_device_kernels, event_record, is_device_kernel, profile_run, time_twice, warm_gpu


def gpu_random_checkpoint(shape: str, root: Path) -> Path:
    "A safetensors folder with random bf16 weights of `shape`, generated on the GPU (fast), tokenizer from the tiny model."
    import shutil
    from safetensors.torch import save_file
    from nanoserve.tokenizer import ensure_default_model, qwen2_weight_shapes
    d = root / f"random-{shape}"
    if (d / "model.safetensors").is_file(): return d
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "qwen2", **SHAPES[shape], "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "dtype": "bfloat16", "rope_theta": 1e6, "use_sliding_window": False}
    (d / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {n: (torch.ones(s, dtype=torch.bfloat16) if n.endswith("norm.weight") else
                   (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02).cpu())
               for n, s in qwen2_weight_shapes(cfg).items()}
    save_file(tensors, str(d / "model.safetensors"), {"format": "pt"})
    for f in ensure_default_model().iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json": shutil.copy(f, d / f.name)
    return d


def nccl_share(run) -> tuple[float, int]:
    "Share of the window covered by NCCL kernels (union), and their count."
    iv = sorted((r["start_us"], r["end_us"]) for r in map(event_record, run.events)
                if is_device_kernel(r) and "nccl" in r["name"].lower())
    total, cur = 0.0, None
    for s, e in iv:
        if cur is None or s > cur[1]:
            if cur: total += cur[1] - cur[0]
            cur = [s, e]
        else: cur[1] = max(cur[1], e)
    if cur: total += cur[1] - cur[0]
    return total / (run.window.end_us - run.window.start_us), len(iv)


def measure(model_dir, res, name, tp, enforce_eager=False, offline=True):
    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype="bfloat16", tensor_parallel_size=tp, enforce_eager=enforce_eager, num_kv_blocks=8192,
              max_num_seqs=32, max_num_batched_tokens=2048)
    start_s = time.perf_counter() - t0
    print(name, "started in", round(start_s, 1), "s:", llm, flush=True)
    row = {"config": name, "tensor_parallel_size": tp, "enforce_eager": enforce_eager, "start_s": start_s, "decode": []}
    g = random.Random(5)
    prompts = [[g.randrange(llm.config.vocab_size) for _ in range(n)] for n in (17, 64, 200, 333)]
    row["greedy_tokens"] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))]
    for b in (1, 8):
        steady_decode(llm, b)
        warm_gpu(2.0, llm.device)
        t = time_twice(llm.step, warmup_s=0.3, repeats=30)
        steps = 16
        with profile_run(llm.device) as run:
            for _ in range(steps): llm.step()
        share, n_nccl = nccl_share(run)
        d = {"batch": b, "ms_per_step": [t.first_ms, t.second_ms], "median_ms": t.median_ms, "disagree": t.disagree,
             "kernels_per_step": count_device_kernels(run.events) / steps, "nccl_kernels_per_step": n_nccl / steps,
             "gpu_busy": busy_share(run), "nccl_share": share, "profiled_ms_per_step": run.wall_s / steps * 1e3}
        print(name, d, flush=True)
        row["decode"].append(d)
    for i in list(llm._requests): llm.abort_request(i)
    if offline:
        spec = WorkloadSpec(kind="lognormal", num_requests=128, prompt_median=256, output_median=128, prompt_max=1024,
                            output_max=512, seed=0)
        reqs = make_workload(spec, llm.config.vocab_size, 4096)
        sp = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
        llm.generate([list(r.prompt_token_ids) for r in reqs[:32]], SamplingParams(max_tokens=8, ignore_eos=True))
        runs = []
        for rep in range(2):
            warm_gpu(2.0, llm.device)
            torch.cuda.synchronize(); t1 = time.perf_counter()
            outs = llm.generate([list(r.prompt_token_ids) for r in reqs], sp)
            torch.cuda.synchronize(); dt = time.perf_counter() - t1
            n = sum(len(o.token_ids) for o in outs)
            runs.append({"seconds": dt, "output_tokens": n, "output_tokens_per_s": n / dt})
            print(name, "offline", runs[-1], flush=True)
        tps = [r["output_tokens_per_s"] for r in runs]
        row["offline"] = {"workload": spec.__dict__, "numerator": "output tokens actually generated (EOS ignored)",
                          "runs": runs, "disagree": (max(tps) - min(tps)) > 0.15 * min(tps)}
    res["rows"].append(row)           # recorded before shutdown (the first run hung in NCCL's teardown)
    t0 = time.perf_counter()
    llm.close()
    row["close_s"] = time.perf_counter() - t0
    del llm; torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cache", default="/tmp/nscache")
    ap.add_argument("--eager", action="store_true", help="also TP=2 with enforce_eager (a control for the graphs)")
    args = ap.parse_args()
    res = {"meta": run_meta() | {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
           "command": "PYTHONPATH=. python kernels/tp_h200.py --out $OUT", "shape": "7B", "dtype": "bfloat16", "rows": []}
    out = Path(args.out) / "tp_h200.json"
    t0 = time.perf_counter()
    model_dir = gpu_random_checkpoint("7B", Path(args.cache))
    res["checkpoint_s"] = time.perf_counter() - t0
    print("checkpoint", model_dir, round(res["checkpoint_s"], 1), "s", flush=True)
    configs = [("tp1", 1, False, True), ("tp2", 2, False, True)] + ([("tp2-eager", 2, True, False)] if args.eager else [])
    for name, tp, eager, offline in configs:
        t1 = time.perf_counter()
        try: measure(model_dir, res, name, tp, eager, offline)
        except Exception as e:
            import traceback; traceback.print_exc(); res[f"{name}_error"] = repr(e)
        print(f"{name}: {time.perf_counter() - t1:.0f} s", flush=True)
        rows = {r["config"]: r for r in res["rows"]}
        if "tp1" in rows and "tp2" in rows and "greedy_agreement" not in res:
            a, b = rows["tp1"]["greedy_tokens"], rows["tp2"]["greedy_tokens"]
            res["greedy_agreement"] = {"identical_sequences": sum(x == y for x, y in zip(a, b)), "sequences": len(a),
                                       "agreeing_prefixes": [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q),
                                                                  len(x)) for x, y in zip(a, b)]}
            print("greedy agreement", res["greedy_agreement"], flush=True)
        out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)          # do not let an interpreter-exit teardown of NCCL hold the device call

"""Tensor parallelism on two GPUs, quickly (~30 s): the built-in trained tiny model, TP=2 against TP=1.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/tp_smoke_h200.py --out $OUT

Checks greedy tokens of TP=2 (CUDA graphs on, async scheduling on: the GPU defaults) against TP=1 in fp32, with
2 sequences at a time so that later prompts are admitted next to running decodes (mixed-step graphs and
device-side token feeds on every rank); times `close()` (NCCL teardown), then starts a second TP=2 engine in
the same process (which needs the first one's process group gone) and generates again. Writes
tp_smoke_h200.json.
"""
import argparse, json, os, sys, time
from pathlib import Path

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)

from nanoserve.bench import run_meta
from nanoserve.engine import LLM, SamplingParams
from nanoserve.tokenizer import default_model

ap = argparse.ArgumentParser(); ap.add_argument("--out", default=".")
args = ap.parse_args()
res = {"meta": run_meta(), "command": "PYTHONPATH=. python kernels/tp_smoke_h200.py --out $OUT"}
out = Path(args.out) / "tp_smoke_h200.json"
prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self", "for i in range("]
sp = SamplingParams(max_tokens=48, temperature=0)
try:
    one = [o.token_ids for o in LLM(default_model(), dtype="float32", max_num_seqs=2,
                                    async_scheduling=False).generate(prompts, sp)]
    for attempt in (1, 2):
        t0 = time.perf_counter()
        llm = LLM(default_model(), dtype="float32", tensor_parallel_size=2, max_num_seqs=2)
        res[f"start_s_{attempt}"] = time.perf_counter() - t0
        two = [o.token_ids for o in llm.generate(prompts, sp)]
        res[f"identical_{attempt}"] = sum(a == b for a, b in zip(one, two))
        res[f"graph_replays_{attempt}"] = llm.runner.graphs.num_replays if llm.runner.graphs else None
        res[f"mixed_replays_{attempt}"] = llm.runner.mixed_graphs.num_replays if llm.runner.mixed_graphs else None
        res[f"async_{attempt}"] = llm.async_scheduling
        t0 = time.perf_counter(); llm.close(); res[f"close_s_{attempt}"] = time.perf_counter() - t0
        print(attempt, {k: v for k, v in res.items() if k.endswith(str(attempt))}, flush=True)
        out.write_text(json.dumps(res, indent=1))
        del llm
except Exception as e:
    import traceback; traceback.print_exc(); res["error"] = repr(e)
res["sequences"] = len(prompts)
out.write_text(json.dumps(res, indent=1))
sys.stdout.flush(); os._exit(0)

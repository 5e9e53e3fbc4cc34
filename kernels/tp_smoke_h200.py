"""Tensor parallelism on two GPUs, quickly (~30 s): the built-in trained tiny model, TP=2 against TP=1.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/tp_smoke_h200.py --out $OUT      # on nvidia-h200-x2

In the tutorials' order:
1. check: greedy tokens of TP=2 (CUDA graphs on, async scheduling on: the GPU defaults) against TP=1 in fp32, with
   2 sequences at a time so that later prompts are admitted next to running decodes (mixed-step graphs and
   device-side token feeds on every rank); then a second TP=2 engine in the same process (which needs the first
   one's process group gone) generates again and must agree too;
2. time: each engine's start and its `close()` (NCCL teardown);
3. write tp_smoke_h200.json after each engine.
`--smoke`: the same on the CPU (two gloo processes, the interpreter, 8 tokens); writes only to a temporary folder.
"""
import os, sys, time
from pathlib import Path

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(k, v)          # never NVLink multicast on the lent machines

sys.path.insert(0, str(Path(__file__).parent))
from lab import LLM, SamplingParams, device_or_skip, is_smoke, parser, tiny_model, write

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self", "for i in range("]


def one_engine(model, sp, reference, res, attempt: int) -> bool:
    "Start a TP=2 engine, generate, compare with TP=1's tokens, close it; its numbers under `_{attempt}` keys."
    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32", tensor_parallel_size=2, max_num_seqs=2)
    res[f"start_s_{attempt}"] = time.perf_counter() - t0
    two = [o.token_ids for o in llm.generate(PROMPTS, sp)]
    res[f"identical_{attempt}"] = sum(a == b for a, b in zip(reference, two))
    res[f"graph_replays_{attempt}"] = llm.runner.graphs.num_replays if llm.runner.graphs else None
    res[f"mixed_replays_{attempt}"] = llm.runner.mixed_graphs.num_replays if llm.runner.mixed_graphs else None
    res[f"async_{attempt}"] = llm.async_scheduling
    t0 = time.perf_counter(); llm.close(); res[f"close_s_{attempt}"] = time.perf_counter() - t0
    print(attempt, {k: v for k, v in res.items() if k.endswith(str(attempt))}, flush=True)
    return res[f"identical_{attempt}"] == len(PROMPTS)


def main():
    args = parser(__doc__).parse_args()
    device_or_skip(args)
    model, sp = tiny_model(), SamplingParams(max_tokens=8 if is_smoke(args) else 48, temperature=0)
    res, ok = {"sequences": len(PROMPTS)}, True
    try:
        one = [o.token_ids for o in LLM(model, dtype="float32", max_num_seqs=2,
                                        async_scheduling=False).generate(PROMPTS, sp)]
        for attempt in (1, 2):
            ok &= one_engine(model, sp, one, res, attempt)
            write("tp_smoke_h200.json", res, args)
    except Exception as e:
        import traceback; traceback.print_exc(); res["error"] = repr(e); ok = False
    write("tp_smoke_h200.json", res, args)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0 if ok else 1)     # no interpreter-exit teardown of NCCL to hold the device call


if __name__ == "__main__":
    main()

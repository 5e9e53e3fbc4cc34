"""The scheduler's persistent batch on the H200: a decode step's time with it on and off, in one process, interleaved.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/persistent_batch_h200.py --out $OUT [--rounds 4]

Two engines on the 0.5B shape (bf16, random weights, the package's defaults: CUDA graphs, asynchronous
scheduling), one with the persistent batch (`persistent_batch=True`, the default) and one with the full pass every
step (the control), each with its own 20,000 KV blocks. In the tutorials' order: check (the same greedy tokens from
both engines for the same requests), time (for batch 1, 64 and 256: each engine in steady decode from 128-token
prompts, the GPU warmed before every row, ms per `LLM.step()` over `--steps` steps, measured twice and flagged
when the two disagree by over 15%; the engines alternate, the order flipping each round), write
persistent_batch_h200.json. `--smoke`: the tiny model on the CPU, batch 1 and 4, 5 steps, one round.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, SamplingParams, checkpoint, device_or_skip, dtype_of, is_smoke, median, parser,  # noqa: E402
                 same_greedy_tokens, steady_decode, step_ms, warm, write)

VARIANTS = {"persistent": True, "full_pass": False}


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    smoke = is_smoke(args)
    device = device_or_skip(args)
    model_dir, shape = checkpoint("0.5B", args)
    batches, steps, rounds = ((1, 4), 5, 1) if smoke else ((1, 64, 256), args.steps, args.rounds)
    engines = {name: LLM(model_dir, dtype=dtype_of(args), device=device.type, max_num_seqs=max(batches),
                         max_num_batched_tokens=max(4096, 128 * max(batches)), num_kv_blocks=20000 if not smoke else 512,
                         persistent_batch=on) for name, on in VARIANTS.items()}
    same = same_greedy_tokens(engines.values())
    assert same, "the engines' greedy tokens differ"
    ms = {b: {name: [] for name in engines} for b in batches}
    for r in range(rounds):
        for b in batches:
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                llm = engines[name]
                steady_decode(llm, b)
                warm(device, 1.0)
                first, second = step_ms(llm, steps), step_ms(llm, steps)
                ms[b][name].append({"ms": [first, second], "disagree": abs(first - second) / min(first, second) > 0.15})
                print(r, b, name, round(first, 4), round(second, 4), flush=True)
    summary = {}
    for b in batches:
        med = {name: median([x for row in rows for x in row["ms"]]) for name, rows in ms[b].items()}
        summary[b] = {"median_ms": med, "persistent_over_full_pass": med["persistent"] / med["full_pass"]}
    print(summary)
    write("persistent_batch_h200.json", {"shape": shape, "steps": steps, "rounds": rounds, "tokens_identical": same,
                                         "ms_per_step": ms, "summary": summary,
                                         "command": "PYTHONPATH=. python kernels/persistent_batch_h200.py --out DIR"}, args)


if __name__ == "__main__":
    main()

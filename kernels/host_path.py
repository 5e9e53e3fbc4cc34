"""The host's share of a decode step, without a GPU: scheduling, sampling rows, packing and bookkeeping at batch 64.

    PYTHONPATH=. python kernels/host_path.py --out figures/data [--label NAME]

Runs on any machine (here a CPU): the built-in tiny model, 64 sequences with 1,000-token prompts (block tables of
~63 blocks, as in steady decode at that context), decode steps packed for the batch-64 CUDA-graph bucket
(`enable_graphs(..., capture=False)`: the same static-buffer layout, no GPU). Times 100 iterations of
schedule + sampling rows + pack + update + reports, three times, and each piece alone; no model forward. Appends
one row (git sha, label, ms) to host_path.json, so the same script run on an older checkout gives the control.
"""
import argparse, json, os, random, subprocess, sys, timeit
from pathlib import Path

from nanoserve.bench import run_meta
from nanoserve.engine import LLM, SamplingParams
from nanoserve.tokenizer import ensure_default_model


def decoding_engine(model_dir, batch: int, prompt_len: int = 1000):
    """A CPU engine with `batch` sequences of `prompt_len` tokens in steady decode, packed for the CUDA-graph buckets
    (`capture=False`), and `one()`: one decode step's host path (schedule, sampling rows, pack, update, reports)."""
    llm = LLM(model_dir, max_num_seqs=batch, max_num_batched_tokens=4096, num_kv_blocks=batch * (prompt_len // 16 + 72),
              device="cpu")
    llm.runner.enable_graphs([b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= batch], llm.max_model_len,
                             capture=False)
    g = random.Random(0)
    for _ in range(batch):
        llm.add_request([g.randrange(llm.config.vocab_size) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True), stream=False)
    sched, runner = llm.scheduler, llm.runner
    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):   # prefill, without the model
        step = sched.schedule(); sched.update(step, [1] * len(step.sample_seq_ids))

    def one():
        step = sched.schedule(); s = llm._sampling(step); x = runner.pack(step, s)
        sched.update(step, [1] * len(step.seqs)); llm._reports(step, 0.0)
        return x
    return llm, one


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="figures/data")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    llm, one = decoding_engine(ensure_default_model(), 64)
    sched, runner, n = llm.scheduler, llm.runner, 100
    x = one()
    assert x.bucket == 64, x.bucket
    total = [timeit.timeit(one, number=n) / n * 1e3 for _ in range(3)]
    def schedule_update():
        step = sched.schedule(); sched.update(step, [1] * len(step.seqs))
    sch = [timeit.timeit(schedule_update, number=n) / n * 1e3 for _ in range(3)]
    step = sched.schedule(); smp = llm._sampling(step)
    pack = [timeit.timeit(lambda: runner.pack(step, smp), number=n) / n * 1e3 for _ in range(3)]
    sched.update(step, [1] * len(step.seqs))
    row = {"label": args.label, "meta": run_meta(), "batch": 64, "block_table_width": x.width,
           "ints_per_step": len(x.ints), "ms_per_step": total, "schedule_update_ms": sch, "pack_ms": pack,
           "best_ms": min(total)}
    print(json.dumps({k: row[k] for k in ("label", "ms_per_step", "schedule_update_ms", "pack_ms")}))
    path = Path(args.out) / "host_path.json"
    data = json.loads(path.read_text()) if path.exists() else {"command": "PYTHONPATH=. python kernels/host_path.py",
                                                                  "rows": []}
    data["rows"].append(row)
    path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()

"""The host's share of a decode step, without a GPU: scheduling, sampling rows, packing and bookkeeping at batch 64.

    PYTHONPATH=. python kernels/host_path.py --out figures/data [--label NAME]

Runs on any machine (here a CPU): the built-in tiny model, 64 sequences with 1,000-token prompts (block tables of
~63 blocks, as in steady decode at that context), decode steps packed for the batch-64 CUDA-graph bucket
(`enable_graphs(..., capture=False)`: the same static-buffer layout, no GPU). In the tutorials' order:
1. check: one step packs for the batch's bucket (64) and every sequence gets its token;
2. time: 100 iterations of schedule + sampling rows + pack + update + reports, three times, and each piece alone;
   no model forward;
3. write: append one row (run metadata, label, ms) to host_path.json, so the same script run on an older checkout
   (PYTHONPATH=<tree>) gives the control.
`--smoke`: batch 4, 64-token prompts, 5 iterations; writes only to a temporary folder.
"""
import sys, timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import decoding_engine, is_smoke, load, meta, parser, tiny_model, write


def check(llm, one, batch: int):
    "One step packs for the batch's own bucket and advances every sequence by one token."
    before = {s.seq_id: s.num_tokens for s in llm.scheduler.running}
    x = one()
    assert x.bucket == batch, (x.bucket, batch)
    after = {s.seq_id: s.num_tokens for s in llm.scheduler.running}
    assert all(after[i] == before[i] + 1 for i in before), "a sequence did not advance by one token"
    return x


def timings(llm, one, n: int) -> dict:
    "ms per step of the whole host path and of its pieces (schedule + update, pack), three times each."
    sched, runner = llm.scheduler, llm.runner
    total = [timeit.timeit(one, number=n) / n * 1e3 for _ in range(3)]

    def schedule_update():
        step = sched.schedule(); sched.update(step, [1] * len(step.sample_seq_ids))
    sch = [timeit.timeit(schedule_update, number=n) / n * 1e3 for _ in range(3)]
    step = sched.schedule(); smp = llm._sampling(step)
    pack = [timeit.timeit(lambda: runner.pack(step, smp), number=n) / n * 1e3 for _ in range(3)]
    sched.update(step, [1] * len(step.sample_seq_ids))
    return {"ms_per_step": total, "schedule_update_ms": sch, "pack_ms": pack, "best_ms": min(total)}


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    smoke = is_smoke(args)
    batch, prompt_len, n = (4, 64, 5) if smoke else (64, 1000, 100)
    llm, one = decoding_engine(tiny_model(), batch, prompt_len=prompt_len)
    x = check(llm, one, batch)
    row = {"label": args.label, "meta": meta(), "batch": batch, "block_table_width": x.width,
           "ints_per_step": len(x.ints), **timings(llm, one, n)}
    print({k: row[k] for k in ("label", "ms_per_step", "schedule_update_ms", "pack_ms")})
    data = load("host_path.json", args, default={"rows": []})
    data["rows"].append(row)
    write("host_path.json", {**data, "command": "PYTHONPATH=. python kernels/host_path.py"}, args)


if __name__ == "__main__":
    main()

"""nano-vllm's workload (256 requests, prompt and output lengths uniform in 100..1024, greedy, EOS ignored) and the
batch-1 decode step, on any checkout of the package, alone or as an interleaved A/B of several checkouts.

One checkout (PYTHONPATH picks the tree; this script and kernels/lab.py come from wherever they are run):

    PYTHONPATH=<tree> python kernels/nanovllm_h200.py --model DIR --label NAME --out FILE.json [--repeats 2]
        [--freeze-gc] [--keep-prefix-cache] [--host-model TINY_DIR]

An A/B in one command, one JSON (trees alternate A B B A ..., one fresh process each; a tree is a folder holding
`nanoserve/`, or a git commit, which is extracted with `git archive` first):

    python kernels/nanovllm_h200.py --ab new=. old=0f60b58 --rounds 2 --out figures/data/FILE.json

Each process, in the tutorials' order:
1. check: greedy tokens in fp32 for a few prompts (an A/B compares them: identical in every tree);
2. time: build the bf16 engine (default KV sizing), one cold run of the workload (compiles, captures: flagged, not
   compared), `--repeats` warm runs without the ledger and one with it (the prefix cache emptied before each, else a
   rerun finds every prompt cached and skips prefill); each run's GC time and a hash of its output tokens; then the
   batch-1 decode step (ms per `LLM.step()`, steady decode, measured twice, >15% apart flagged);
   with `--host-model`, also the host alone: the whole workload through a CPU engine whose runner returns at once,
   and the per-step host path at batch 64 and 256 (how fast this machine's host is);
3. write the JSON. The A/B's JSON holds every process's record and a summary: per tree the medians, and each
   tree against the first (ratio of medians, within 3%?, tokens identical?).
`--smoke`: the tiny model on the CPU under the Triton interpreter, a few short requests, an A/B of this tree against
itself (two processes); writes only to a temporary folder.
"""
import gc, hashlib, json, os, random, subprocess, sys, tempfile, time, timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (LLM, REPO, SamplingParams, decoding_engine, device_or_skip, is_smoke, median, meta, out_path,
                 parser, steady_decode, sync, time_wall, tiny_model, twice, warm, write)

import torch

from nanoserve.bench import WorkloadSpec, make_workload
from nanoserve.engine import StepLedger

WORKLOAD = "256 requests, prompt and output uniform 100..1024, greedy, EOS ignored, seed 0"


def requests(vocab_size: int, num_requests: int = 256, smoke: bool = False):
    "nano-vllm's workload as prompts and sampling parameters (under --smoke: 16-token prompts, 4 tokens out)."
    reqs = make_workload(WorkloadSpec(kind="nanovllm", num_requests=num_requests, seed=0), vocab_size, 32768)
    prompts = [list(r.prompt_token_ids)[:16 if smoke else None] for r in reqs]
    return prompts, [SamplingParams(max_tokens=4 if smoke else r.max_tokens, temperature=0, ignore_eos=True)
                     for r in reqs]


def tokens_sha1(token_lists) -> str:
    "A short hash of the output tokens: equal in two trees when the greedy tokens are."
    return hashlib.sha1(json.dumps(token_lists).encode()).hexdigest()[:16]


class GcClock:
    "Seconds spent in the garbage collector while attached (gc.callbacks)."
    def __init__(self): self.seconds, self.collections, self._t = 0.0, [0, 0, 0], None
    def __call__(self, phase, info):
        if phase == "start": self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t; self.collections[info["generation"]] += 1


# ---- check -----------------------------------------------------------------------------------------------------
def fp32_greedy(model_dir, smoke: bool) -> dict:
    "Greedy tokens in fp32 for a few prompts of random ids: the tokens every tree must produce alike."
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256 if smoke else 2048, max_num_seqs=8)
    g = random.Random(7)
    prompts = [[g.randrange(llm.config.vocab_size) for _ in range(n)] for n in ((5, 17) if smoke else (7, 64, 130, 257))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4 if smoke else 48, temperature=0, ignore_eos=True))
    toks = [o.token_ids for o in outs]
    del llm, outs; gc.collect()
    if torch.cuda.is_available(): torch.cuda.empty_cache()
    print("fp32 greedy", tokens_sha1(toks), flush=True)
    return {"prompt_lens": [len(p) for p in prompts], "tokens": toks, "tokens_sha1": tokens_sha1(toks)}


# ---- time ------------------------------------------------------------------------------------------------------
def ledger_summary(rows) -> dict:
    "Seconds per ledger phase, summed over decode-only steps by batch band and over the other steps."
    out = {}
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
        out[name] = s
    return out


def run_once(llm, prompts, sp, ledger: bool, keep_prefix_cache: bool = False) -> dict:
    """One timed `generate` of the workload. Unless `keep_prefix_cache`, the prefix cache is emptied first, so the
    run computes every prompt (a rerun of the same prompts would otherwise find them cached and skip prefill)."""
    if not keep_prefix_cache: llm.block_manager.reset_prefix_cache()
    clock = GcClock(); gc.callbacks.append(clock)
    llm.ledger = StepLedger() if ledger else None
    llm._last_step_end = None              # the first step's gap is not the warm-up
    warm(llm.device)
    sync(llm.device); t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    sync(llm.device); dt = time.perf_counter() - t0
    gc.callbacks.remove(clock)
    n = sum(len(o.token_ids) for o in outs)
    row = {"seconds": dt, "output_tokens": n, "output_tokens_per_s": n / dt, "ledger": ledger,
           "tokens_sha1": tokens_sha1([o.token_ids for o in outs]), "gc_seconds": clock.seconds,
           "gc_collections": clock.collections, "preemptions": sum(o.num_preemptions for o in outs)}
    if ledger:
        row["ledger_summary"] = ledger_summary(llm.ledger.rows)
        llm.ledger = None
    print(json.dumps({k: v for k, v in row.items() if k != "ledger_summary"}), flush=True)
    for k, v in row.get("ledger_summary", {}).items():
        print(" ", k, {a: (round(b * 1e3 / v["steps"], 3) if isinstance(b, float) else b) for a, b in v.items()},
              "(ms a step)", flush=True)
    return row


def decode_batch1(llm, smoke: bool) -> dict:
    """ms per `LLM.step()` at batch 1 in steady decode (128-token prompt): the host's clock with the device
    synchronised after each step, median of 200 steps, measured twice."""
    reps, prompt_len = (4, 16) if smoke else (200, 128)
    steady_decode(llm, 1, prompt_len=prompt_len)
    warm(llm.device)
    a, b, flag = twice(lambda: median(time_wall(llm.step, reps, warmup=reps // 10, device=llm.device)) * 1e3)
    for i in list(llm._requests): llm.abort_request(i)
    print("decode batch 1", round(a, 4), round(b, 4), "ms", "DISAGREE" if flag else "", flush=True)
    return {"ms_per_step": [a, b], "median_ms": median([a, b]), "disagree": flag, "steps_each": reps,
            "prompt_len": prompt_len}


def host_path(llm_dir, batch: int, smoke: bool) -> list[float]:
    "ms a step of the host path alone at `batch` (1,000-token prompts, graph-bucket packing, no GPU work), 3 times."
    llm, one = decoding_engine(llm_dir, batch, prompt_len=64 if smoke else 1000)
    one()
    n = 5 if smoke else 50
    out = [timeit.timeit(one, number=n) / n * 1e3 for _ in range(3)]
    del llm
    return out


def host_generate(llm_dir, repeats: int = 3, num_requests: int = 256, smoke: bool = False) -> list[float]:
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
    lo, hi = (8, 33) if smoke else (100, 1025)
    prompts = [[g.randrange(llm.config.vocab_size) for _ in range(g.randrange(lo, hi))] for _ in range(num_requests)]
    sp = [SamplingParams(max_tokens=g.randrange(lo, hi), temperature=0, ignore_eos=True) for _ in range(num_requests)]
    out = []
    gc.collect(); gc.freeze()             # as the engine's `freeze_gc` does (not in the old trees)
    for _ in range(repeats):
        llm.block_manager.reset_prefix_cache()
        t0 = time.perf_counter(); outs = llm.generate(prompts, sp); dt = time.perf_counter() - t0
        out.append(sum(len(o.token_ids) for o in outs) / dt)
    gc.unfreeze()
    del llm
    return out


def one_tree(args) -> dict:
    "Everything one process measures on the tree PYTHONPATH picked: check, then time; returns the record."
    smoke = is_smoke(args)
    device_or_skip(args)
    model = args.model or str(tiny_model())
    res = {"label": args.label, "meta": meta(), "package": str(Path(sys.modules["nanoserve"].__file__).parent),
           "workload": WORKLOAD, "numerator": "output tokens actually generated", "model": model}
    res["fp32_greedy"] = fp32_greedy(model, smoke)
    if args.host_model:
        nreq = 8 if smoke else 256
        res["host_generate_tok_s"] = host_generate(args.host_model, 1 if smoke else 3, nreq, smoke)
        print("host-only generate, tok/s", [round(x) for x in res["host_generate_tok_s"]], flush=True)
        for b in ((4,) if smoke else (64, 256)):
            res[f"host_path_b{b}_ms"] = host_path(args.host_model, b, smoke)
            print("host path", b, [round(x, 3) for x in res[f"host_path_b{b}_ms"]], flush=True)
    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32" if smoke else "bfloat16", max_num_seqs=256, max_num_batched_tokens=16384,
              **({"num_kv_blocks": 512} if smoke else {}))
    res["build_seconds"], res["num_kv_blocks"] = time.perf_counter() - t0, llm.num_kv_blocks
    res["freeze_gc"], res["keep_prefix_cache"] = args.freeze_gc, args.keep_prefix_cache
    if args.freeze_gc:
        gc.collect(); gc.freeze()
        res["gc_frozen_objects"] = gc.get_freeze_count()
    prompts, sp = requests(llm.config.vocab_size, args.num_requests or (4 if smoke else 256), smoke)
    llm.generate([p[:32] for p in prompts[:8]], SamplingParams(max_tokens=8 if not smoke else 2, ignore_eos=True))
    keep = args.keep_prefix_cache
    res["runs"] = [dict(run_once(llm, prompts, sp, False, keep), cold=True)]
    res["runs"] += [run_once(llm, prompts, sp, False, keep) for _ in range(args.repeats)]
    res["runs"].append(run_once(llm, prompts, sp, True, keep))
    res["decode_batch1"] = decode_batch1(llm, smoke)
    return res


# ---- the A/B ---------------------------------------------------------------------------------------------------
def git(*argv, cwd=REPO) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def resolve_tree(spec: str, workdir: Path) -> dict:
    """`label=tree`: a folder holding nanoserve/ (its git sha when git knows it), or a commit, extracted with
    `git archive` into `workdir` (the package folder only)."""
    label, _, tree = spec.partition("=")
    if not tree: raise SystemExit(f"--ab wants label=tree, got {spec!r}")
    path = Path(tree)
    if (path / "nanoserve" / "__init__.py").is_file():
        try:
            sha = git("rev-parse", "--short", "HEAD", cwd=path)
            if git("status", "--porcelain", "--", "nanoserve", cwd=path): sha += "+changes"
        except (subprocess.CalledProcessError, FileNotFoundError):
            sha = os.environ.get("NANOSERVE_GIT_SHA", "unknown")
        return {"label": label, "path": str(path.resolve()), "sha": sha}
    try:
        sha = git("rev-parse", "--short", "--verify", f"{tree}^{{commit}}")
        dest = workdir / sha; dest.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", sha, "nanoserve"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        raise SystemExit(f"{tree!r} is neither a folder with nanoserve/ nor a commit git can extract here ({e}); "
                         f"extract it first: mkdir -p _ab/{tree} && git archive {tree} nanoserve | tar -x -C _ab/{tree}")
    return {"label": label, "path": str(dest), "sha": sha, "ref": tree}


def child_argv(args, label: str, out: Path) -> list[str]:
    "This script's command line for one tree's process."
    argv = [sys.executable, str(Path(__file__).resolve()), "--label", label, "--out", str(out),
            "--repeats", str(args.repeats)]
    if args.model: argv += ["--model", str(Path(args.model).resolve())]
    if args.num_requests: argv += ["--num-requests", str(args.num_requests)]
    if args.host_model: argv += ["--host-model", str(Path(args.host_model).resolve())]
    argv += [f for f, on in (("--freeze-gc", args.freeze_gc), ("--keep-prefix-cache", args.keep_prefix_cache),
                             ("--smoke", is_smoke(args))) if on]
    return argv


def child_name(label: str) -> str: return f"nanovllm_{label}_h200.json"


def summarize(trees: list[dict], processes: list[dict]) -> dict:
    "Per tree the medians over its processes; each tree against the first: ratios, within 3%, tokens identical."
    per = {}
    for t in trees:
        ps = [p for p in processes if p.get("label") == t["label"]]
        warm_runs = [r for p in ps for r in p.get("runs", []) if not r.get("cold") and not r["ledger"]]
        per[t["label"]] = {
            "processes": len(ps), "sha": t["sha"],
            "nanovllm_tok_s": [r["output_tokens_per_s"] for r in warm_runs],
            "nanovllm_tok_s_median": median([r["output_tokens_per_s"] for r in warm_runs]) if warm_runs else None,
            "decode_b1_ms": [x for p in ps for x in p["decode_batch1"]["ms_per_step"]],
            "decode_b1_ms_median": median([x for p in ps for x in p["decode_batch1"]["ms_per_step"]]) if ps else None,
            "fp32_tokens_sha1": sorted({p["fp32_greedy"]["tokens_sha1"] for p in ps}),
            "workload_tokens_sha1": sorted({r["tokens_sha1"] for p in ps for r in p.get("runs", [])})}
    base = per[trees[0]["label"]]
    against = {}
    for t in trees[1:]:
        o = per[t["label"]]
        tok = base["nanovllm_tok_s_median"] / o["nanovllm_tok_s_median"]     # > 1: the first tree is faster
        step = base["decode_b1_ms_median"] / o["decode_b1_ms_median"]        # > 1: the first tree is slower
        against[t["label"]] = {
            "nanovllm_tok_s_ratio": tok, "decode_b1_ms_ratio": step,
            "within_3pct": abs(tok - 1) <= 0.03 and abs(step - 1) <= 0.03,
            "fp32_tokens_identical": len(set(base["fp32_tokens_sha1"] + o["fp32_tokens_sha1"])) == 1,
            "workload_tokens_identical": len(set(base["workload_tokens_sha1"] + o["workload_tokens_sha1"])) == 1}
    return {"per_tree": per, f"{trees[0]['label']}_against": against,
            "ratios": f"{trees[0]['label']}'s median over the other's: tok/s above 1 and ms below 1 favour it"}


def ab(args) -> dict:
    """Run one fresh process per tree, alternating (A B, then B A, ...) for `--rounds` rounds; every process's
    record, and the summary."""
    work = Path(tempfile.mkdtemp(prefix="nanoserve-ab-"))
    trees = [resolve_tree(s, work) for s in args.ab]
    res = {"what": "interleaved A/B: " + ", ".join(f"{t['label']}={t['sha']}" for t in trees), "trees": trees,
           "rounds": args.rounds, "workload": WORKLOAD, "processes": []}
    for r in range(args.rounds):
        for t in (trees if r % 2 == 0 else trees[::-1]):
            out = work / f"{t['label']}_{r}"               # the child's --out (and its --smoke folder)
            env = {**os.environ, "PYTHONPATH": t["path"], "NANOSERVE_GIT_SHA": t["sha"], "NANOSERVE_AB_CHILD": "1",
                   "NANOSERVE_SMOKE_OUT": str(out)}
            print(f"=== round {r}: {t['label']} ({t['sha']}, {t['path']})", flush=True)
            p = subprocess.run(child_argv(args, t["label"], out), env=env, cwd=t["path"])   # `python -m` finds it too
            path = out / child_name(t["label"])
            rec = json.loads(path.read_text()) if path.is_file() else {"label": t["label"]}
            rec.update(round=r, returncode=p.returncode)
            res["processes"].append(rec)
            if p.returncode != 0: raise SystemExit(f"{t['label']}'s process failed ({p.returncode}); see above")
    res["summary"] = summarize(trees, res["processes"])
    print(json.dumps(res["summary"], indent=1), flush=True)
    return res


def main():
    ap = parser(__doc__)
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: the built-in tiny model)")
    ap.add_argument("--label", default="tree")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--freeze-gc", action="store_true", help="gc.collect() + gc.freeze() after the engine is built")
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="do not empty the prefix cache between runs (reruns then skip most of prefill)")
    ap.add_argument("--num-requests", type=int, default=None, help="fewer than 256 for a quick run")
    ap.add_argument("--host-model", default=None, help="a small checkpoint for the host-path timing (CPU)")
    ap.add_argument("--ab", nargs="+", metavar="LABEL=TREE", default=None,
                    help="an interleaved A/B of these trees (folders with nanoserve/, or git commits), one JSON")
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds (each runs every tree once)")
    args = ap.parse_args()
    smoke_ab = is_smoke(args) and args.ab is None and "NANOSERVE_AB_CHILD" not in os.environ
    if smoke_ab:                      # the smoke run checks the A/B path: this tree against itself, one round
        args.ab, args.rounds, args.repeats = ["a=" + str(REPO), "b=" + str(REPO)], 1, 1
    if args.ab:
        device_or_skip(args)
        res = ab(args)
        name = "nanovllm_ab_h200.json"
    else:
        res = one_tree(args)
        name = child_name(args.label)
    write(name, res, args)


if __name__ == "__main__":
    main()

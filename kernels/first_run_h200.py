"""The engine alone's first Poisson run on a machine against its next (issue 28: the first-run stall), per tree.

    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/first_run_h200.py --out $OUT [--trees new=.,old=DIR]

Every file of the serving-path notes shows the engine alone's first Poisson run in a fresh process with a p99 time
to first token near 200 ms, and no later run. The hypothesis: a kernel the benchmark's warm-up does not reach is
compiled during that run, then found in Triton's disk cache by every later process. For each tree (a checkout of
the package: `new=.` and a control) this starts from an empty Triton cache (`TRITON_CACHE_DIR`, a fresh folder)
and runs the server chapter's Poisson workload (0.5B shape, bf16, random weights, `clients_h200.POISSON_RATE`)
twice, each in a fresh process through `nanoserve.bench.run_benchmark` (warm-up included, as `nanoserve bench`
runs it): the first on the empty cache, the second on what the first left. Each run's TTFT p50 / p99 / mean and
tokens/s, and the Triton kernels written to the cache while its timed requests ran (by file time: after the run's
wall time began), which name what the warm-up missed. The trees alternate. Writes first_run_h200.json.
`--smoke`: the built-in tiny model on the CPU, six requests, one tree.
"""
import json, os, subprocess, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import checkpoint, device_or_skip, is_smoke, parser, write  # noqa: E402


def cache_kernels(cache: Path) -> dict[str, float]:
    "Triton's cache folder: each compiled kernel's metadata file (hash/name.json) -> its modification time."
    return {f"{p.parent.name}/{p.stem}": p.stat().st_mtime for p in cache.glob("*/*.json")
            if not p.name.startswith("__grp__")}


def child(model_dir: str, smoke: bool) -> dict:
    "One run in this process's tree (the parent set PYTHONPATH and TRITON_CACHE_DIR): its summary and new kernels."
    from clients_h200 import POISSON_RATE, Settings
    from nanoserve.bench import model_limits, run_benchmark
    s = Settings(smoke)
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    before = cache_kernels(cache)
    out = run_benchmark(model_dir, s.spec, ["continuous"], engine_kwargs=s.engine, rates=[POISSON_RATE], repeats=1,
                        warmup_s=0.0 if smoke else 3.0, progress=False, profile_steps=0,
                        limits=model_limits(model_dir, s.engine))
    t_end = time.time()
    rep = out["runs"][0]["reps"][0]
    after = cache_kernels(cache)
    timed_from = t_end - rep["summary"]["wall_s"]
    ttfts = [r["ttft_s"] for r in rep["per_request"] if r.get("ttft_s") is not None]
    return {"summary": rep["summary"] | {"ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_max_s": max(ttfts)},
            "num_kernels_written": len(set(after) - set(before)),
            "written_while_timed": sorted(k.split("/")[1] for k, t in after.items() if k not in before and t >= timed_from)}


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--trees", default="new=.", help="comma-separated name=path of package checkouts")
    ap.add_argument("--child", default=None, help="(internal) run once with this checkpoint and print the result")
    args = ap.parse_args()
    smoke = is_smoke(args)
    if args.child:                                            # one run, in the tree on PYTHONPATH
        print("RESULT " + json.dumps(child(args.child, smoke)), flush=True)
        return
    device_or_skip(args)
    model_dir, shape = checkpoint("0.5B", args)
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    caches = {name: Path(tempfile.mkdtemp(prefix=f"triton-{name}-")) for name in trees}
    runs = {name: [] for name in trees}
    for which in ("first", "second"):
        for name, path in trees.items():
            env = {**os.environ, "TRITON_CACHE_DIR": str(caches[name]),
                   "PYTHONPATH": os.pathsep.join([str(Path(path).resolve()), str(Path(__file__).parent)]
                                                 + os.environ.get("PYTHONPATH", "").split(os.pathsep))}
            cmd = [sys.executable, __file__, "--child", str(model_dir)] + (["--smoke"] if smoke else [])
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None: raise RuntimeError(f"{name} {which}: no result\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
            runs[name].append({"run": which, **json.loads(line[7:])})
            sm = runs[name][-1]["summary"]
            print(name, which, {k: round(sm[k], 4) for k in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "ttft_max_s",
                                                             "output_tokens_per_s")},
                  "while timed:", runs[name][-1]["written_while_timed"], flush=True)
    write("first_run_h200.json", {"shape": shape, "trees": trees, "runs": runs,
                                  "command": "PYTHONPATH=. python kernels/first_run_h200.py --trees " + args.trees}, args)


if __name__ == "__main__":
    main()

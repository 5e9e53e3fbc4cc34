"""The lab's one shared helper module: arguments, the device, warm-up, timing, run metadata, writing data.

Every script in kernels/ starts the same way and then imports only the package and this module:

    import sys; from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))      # the only sys.path use in the lab
    from lab import parser, is_smoke, device_or_skip, warm, time_cuda, twice, write

and runs in the Triton tutorials' order: check (the kernel or engine against its reference), then time, then write
the data. `--smoke` runs the same code on tiny shapes on the CPU under the Triton interpreter in seconds and writes
only into a temporary folder, never into figures/data; CI runs every script that way (tests/test_lab_smoke.py).

Importing this module with `--smoke` on the command line sets TRITON_INTERPRET=1 and hides the GPUs
(CUDA_VISIBLE_DEVICES=""): both must happen before torch or the package is imported, which is why scripts import
`lab` first. That is the lab's job, not the package's: the package reads TRITON_INTERPRET and never writes it.
"""
import argparse, json, os, random, statistics, sys, tempfile, time
from pathlib import Path

SMOKE_ARGV = "--smoke" in sys.argv[1:]
if SMOKE_ARGV:                                       # before torch and triton are imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

try:
    from nanoserve.measure import run_meta
except ImportError:                                  # older trees keep it in bench
    try:
        from nanoserve.bench import run_meta
    except ImportError:
        run_meta = None

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "figures" / "data"
FLAG = 0.15                                          # two timings further apart than this are flagged


# ---- arguments -------------------------------------------------------------------------------------------------
def parser(description: str, out: str | None = None, parts: str | None = None) -> argparse.ArgumentParser:
    """An argument parser with the lab's two common flags: `--smoke` (tiny shapes on the CPU under the Triton
    interpreter, output to a temporary folder) and `--out` (a folder, or a file ending in .json; default `out`, or
    $OUT, or the current folder). With `parts` (comma-separated names), also `--parts`, defaulting to them."""
    ap = argparse.ArgumentParser(description=description.strip().splitlines()[0] if description else None,
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=description)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU under TRITON_INTERPRET=1 (seconds); writes only to a temp folder")
    ap.add_argument("--out", default=out if out is not None else os.environ.get("OUT", "."),
                    help="a folder for the JSON, or a .json file")
    if parts is not None: ap.add_argument("--parts", default=parts, help=f"comma-separated, of: {parts}")
    return ap


def is_smoke(args) -> bool:
    "Whether this run is a smoke run (`--smoke`)."
    return bool(getattr(args, "smoke", False))


def device_or_skip(args) -> torch.device:
    """The device a run uses: the CPU under `--smoke`; otherwise the first CUDA GPU, and when there is none the
    script says so and exits with status 0 (nothing to measure here; `--smoke` runs the code on a CPU)."""
    if is_smoke(args): return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{Path(sys.argv[0]).name}: no CUDA GPU here; nothing to measure (run with --smoke to check the code)")
        raise SystemExit(0)
    return torch.device("cuda", torch.cuda.current_device())


# ---- timing ----------------------------------------------------------------------------------------------------
def sync(device=None) -> None:
    "Wait for `device`'s queued work (a no-op on a CPU)."
    d = torch.device(device) if device is not None else None
    if (d is None and torch.cuda.is_available()) or (d is not None and d.type == "cuda"): torch.cuda.synchronize(d)


def warm(device, seconds: float = 3.0, size: int = 8192) -> int:
    """Sustained bf16 matmuls on a CUDA `device` for `seconds`, so that clocks have ramped before a measurement;
    returns how many ran (0 on a CPU, where there is nothing to ramp)."""
    d = torch.device(device)
    if d.type != "cuda" or seconds <= 0: return 0
    a = torch.randn(size, size, device=d, dtype=torch.bfloat16)
    b, out = torch.randn_like(a), torch.empty_like(a)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b, out=out); torch.cuda.synchronize(d); n += 1
    return n


def time_cuda(fn, reps: int = 20, warmup: int = 3, device=None) -> list[float]:
    """Seconds of each of `reps` calls of `fn` after `warmup` untimed ones: CUDA events around each call on a GPU,
    `time.perf_counter` on a CPU (or when `device` is a CPU)."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    for _ in range(warmup): fn()
    if not cuda:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter(); fn(); out.append(time.perf_counter() - t0)
        return out
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in events]


def time_wall(fn, reps: int = 20, warmup: int = 3, device=None) -> list[float]:
    """Seconds of each of `reps` calls of `fn` after `warmup` untimed ones, by the host's clock with the device
    synchronised after each call: what a caller waits for a whole engine step (host work included)."""
    for _ in range(warmup): fn()
    sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); sync(device); out.append(time.perf_counter() - t0)
    return out


def disagree(a: float, b: float, threshold: float = FLAG) -> bool:
    "Whether two measurements of one thing differ by more than `threshold` of the smaller."
    lo = min(a, b)
    return (a != b) if lo <= 0 else abs(a - b) / lo > threshold


def twice(fn, threshold: float = FLAG) -> tuple:
    """Measure twice: `fn()` returns one number (say a median time); returns (first, second, disagree), with
    disagree True when they differ by more than 15% of the smaller (the pair is then not to be trusted)."""
    a, b = fn(), fn()
    return a, b, disagree(a, b, threshold)


def median(xs) -> float: return statistics.median(xs)


def rel_err(a, b) -> float:
    "‖a - b‖ / ‖b‖ in fp32."
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- data ------------------------------------------------------------------------------------------------------
def _fallback_meta() -> dict:
    import platform, subprocess
    sha = os.environ.get("NANOSERVE_GIT_SHA") or subprocess.run(
        ["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    return {"git_sha": sha or "unknown", "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def meta() -> dict:
    "The run's provenance: `nanoserve.measure.run_meta()` (git sha, versions, GPU, date)."
    return run_meta() if run_meta is not None else _fallback_meta()


def command() -> str:
    "The command line that made this run, as the data files record it."
    return " ".join(["python", f"kernels/{Path(sys.argv[0]).name}", *sys.argv[1:]])


_smoke_dir = None


def out_path(path, args) -> Path:
    """Where `path` (a JSON file name or path) is written: under `--smoke` into a temporary folder; else into
    `--out` (the file itself when it ends in .json, else the folder), or `path` as given when there is no --out."""
    global _smoke_dir
    name = Path(path).name
    if is_smoke(args):
        if _smoke_dir is None:                   # the driver may name the folder (NANOSERVE_SMOKE_OUT)
            given = os.environ.get("NANOSERVE_SMOKE_OUT")
            _smoke_dir = Path(given) if given else Path(tempfile.mkdtemp(prefix="nanoserve-smoke-"))
            if REPO in _smoke_dir.resolve().parents: raise SystemExit(f"--smoke must write outside the repository, not into {given}")
        return _smoke_dir / name
    out = getattr(args, "out", None)
    if not out: return Path(path)
    return Path(out) if str(out).endswith(".json") else Path(out) / name


def load(path, args, default=None):
    "The JSON already at `out_path(path, args)` (a file a script appends to), or `default`."
    p = out_path(path, args)
    return json.loads(p.read_text()) if p.is_file() else default


def write(path, data: dict, args) -> Path:
    """Write `data` as JSON to `out_path(path, args)` with the run's provenance under "meta" (unless `data` has it)
    and the command under "command" (likewise); under `--smoke` also "smoke": true. Returns the path written."""
    p = out_path(path, args)
    out = {"meta": meta(), "command": command(), **data}
    if is_smoke(args): out["smoke"] = True
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {p}", flush=True)
    return p


def run_parts(parts: dict, names: str, save) -> None:
    """Run the comma-separated `names` of `parts` (name -> function) in order; a failing part is recorded by
    `save(name, error)` and the rest still run; `save(name, None)` after each part that finished."""
    for name in [n for n in names.split(",") if n]:
        if name not in parts: raise SystemExit(f"unknown part {name!r}: one of {', '.join(parts)}")
        t0 = time.perf_counter()
        try:
            parts[name](); err = None
        except Exception as e:
            import traceback; traceback.print_exc(); err = repr(e)
        print(f"part {name}: {time.perf_counter() - t0:.1f} s" + (f" FAILED {err}" if err else ""), flush=True)
        save(name, err)


# ---- engines ---------------------------------------------------------------------------------------------------
from nanoserve.engine import LLM, SamplingParams      # noqa: E402  (after the environment above is set)


def tiny_model() -> Path:
    "The package's built-in tiny checkpoint (made once in the cache): what every `--smoke` run serves."
    from nanoserve.tokenizer import ensure_default_model
    return ensure_default_model()


def steady_decode(llm, batch: int, prompt_len: int = 128, seed: int = 0) -> None:
    "Abort everything, add `batch` greedy requests of `prompt_len` random tokens, run their prefill: decode from here."
    for i in list(llm._requests): llm.abort_request(i)
    g = random.Random(seed)
    for _ in range(batch):
        llm.add_request([g.randrange(llm.config.vocab_size) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=min(4000, llm.max_model_len - prompt_len), temperature=0,
                                       ignore_eos=True), stream=False)
    while any(r.seq.num_computed_tokens < r.seq.num_prompt_tokens for r in llm._requests.values()): llm.step()


def decoding_engine(model_dir, batch: int, prompt_len: int = 1000, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)):
    """A CPU engine with `batch` sequences of `prompt_len` tokens in steady decode, packed for the CUDA-graph buckets
    (`capture=False`: the static-buffer layout, no GPU), and `one()`: one decode step's host path (schedule,
    sampling rows, pack, update, reports) with no model forward. Returns (llm, one)."""
    llm = LLM(model_dir, max_num_seqs=batch, max_num_batched_tokens=4096,
              num_kv_blocks=batch * (prompt_len // 16 + 72), device="cpu")
    llm.runner.enable_graphs([b for b in buckets if b <= batch], llm.max_model_len, capture=False)
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

"""The lab's one shared helper module: arguments, the device, warm-up, timing, run metadata, writing data, and the
pieces several engine experiments share (steady decode, graph_bench over weight copies, step rates, decode rows,
memory floors, nano-vllm's workload, offline runs in fresh processes through `nanoserve.bench.run_benchmark`), and
those the quant experiments share (a shape's layer shapes, seeded layers, errors against the reference, decode
step passes).

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
import argparse, json, os, random, re, statistics, sys, tempfile, time
from pathlib import Path

SMOKE_ARGV = "--smoke" in sys.argv[1:]
if SMOKE_ARGV:                                       # before torch and triton are imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

try:
    from nanoserve.measure import run_meta
except ImportError:                                  # an older tree A/B'd by nanovllm_h200.py: lab's own metadata
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
    "The fields of `nanoserve.measure.run_meta()`, for a tree that has none (the A/B's older checkouts)."
    import platform, subprocess
    sha = os.environ.get("NANOSERVE_GIT_SHA") or subprocess.run(
        ["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    out = {"git_sha": sha or "unknown", "python": platform.python_version(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for name in ("transformers", "triton"):
        try: out[name] = __import__(name).__version__
        except ImportError: pass
    return out


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
            if REPO in _smoke_dir.resolve().parents:
                raise SystemExit(f"--smoke must write outside the repository, not into {given}")
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


def run_parts(parts: dict, names: str, save, seconds: dict | None = None) -> None:
    """Run the comma-separated `names` of `parts` (name -> function) in order; a failing part is recorded by
    `save(name, error)` and the rest still run; `save(name, None)` after each part that finished. With `seconds`
    (a dict), each part's duration is put there by name before `save` is called."""
    for name in [n for n in names.split(",") if n]:
        if name not in parts: raise SystemExit(f"unknown part {name!r}: one of {', '.join(parts)}")
        t0 = time.perf_counter()
        try:
            parts[name](); err = None
        except Exception as e:
            import traceback; traceback.print_exc(); err = repr(e)
        if seconds is not None: seconds[name] = time.perf_counter() - t0
        print(f"part {name}: {time.perf_counter() - t0:.1f} s" + (f" FAILED {err}" if err else ""), flush=True)
        save(name, err)


def saver(name: str, res: dict, args):
    """The `save` of `run_parts` for a script whose results are one dict `res`: a failed part's error goes into
    res[f"{part}_error"], and `res` is written (as `name`, through `write`) after every part."""
    def save(part, err):
        if err: res[f"{part}_error"] = err
        write(name, res, args)
    return save


# ---- compiled for sm_90 on the CPU (Triton's own ptxas, nvdisasm and cuobjdump; no GPU) ----------------------------
def disassemble(cubin: bytes) -> tuple[str, dict]:
    "nvdisasm's SASS (with source lines) and cuobjdump's resource usage (REG, SHARED, STACK, ...) of a cubin."
    import subprocess
    import triton
    tools = Path(triton.__file__).parent / "backends/nvidia/bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin); f.flush()
        sass = subprocess.run([tools / "nvdisasm", "-c", "-g", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([tools / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|SHARED|STACK|LOCAL):(\d+)", res)}
    return sass, usage


def instructions(sass: str) -> tuple[list[tuple[int, str, str, str]], dict[str, int]]:
    "SASS -> [(address, opcode, source 'file:line', text)], and each label's address."
    ins, labels, pending, src = [], {}, [], "?"
    for line in sass.splitlines():
        if m := re.match(r"\s*//## File \"(.*?)\", line (\d+)", line):
            src = f"{Path(m.group(1)).name}:{m.group(2)}"
        elif m := re.match(r"^(\.L_x_\d+):", line.strip()):
            pending.append(m.group(1))
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            addr, text = int(m.group(1), 16), m.group(2).strip()
            for lab in pending: labels[lab] = addr
            pending = []
            ins.append((addr, re.sub(r"^@!?U?P\w+\s+", "", text).split()[0], src, text))
    return ins, labels


def main_loop(sass: str) -> tuple[list, list]:
    "(the largest loop's instructions, all instructions): a loop is the range of a branch to an earlier label."
    ins, labels = instructions(sass)
    best = []
    for addr, op, _, text in ins:
        t = re.search(r"`\((\.L_x_\d+)\)", text)
        if op.startswith("BRA") and t and labels[t.group(1)] < addr:
            body = [i for i in ins if labels[t.group(1)] <= i[0] <= addr]
            if len(body) > len(best): best = body
    return best, ins


# ---- engines ---------------------------------------------------------------------------------------------------
# after the environment above is set; names every tree the A/B of nanovllm_h200.py runs has (0f60b58's too)
from nanoserve.bench import SHAPES, WorkloadSpec, make_workload, random_checkpoint, run_benchmark   # noqa: E402
from nanoserve.engine import LLM, SamplingParams, StepLedger                                # noqa: E402
from nanoserve.measure import (busy_share, copy_bandwidth_GBps, count_device_kernels, decode_floor_ms,  # noqa: E402
                               event_record, is_device_kernel, kv_bytes_per_token, model_weight_bytes, profile_run,
                               time_twice)


def kernel_table(run, calls: int = 1, top: int = 30) -> dict:
    "Device kernel time of a profiled run by name (µs a call, and launches), the `top` largest, and the total."
    by_name, count = {}, {}
    for e in run.events:
        if not is_device_kernel(e): continue
        r = event_record(e)
        name = r["name"][:100]
        by_name[name] = by_name.get(name, 0.0) + (r["end_us"] - r["start_us"]) / calls
        count[name] = count.get(name, 0) + 1
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"total_us": sum(by_name.values()), "kernels": sum(count.values()) / calls,
            "by_name": {k: {"us": v, "count": count[k] / calls} for k, v in rows}}


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


def step_ms(llm, steps: int) -> float:
    "ms per `LLM.step()` over `steps` steps of the engine's steady decode (the device synchronised at both ends)."
    sync(llm.device)
    t0 = time.perf_counter()
    for _ in range(steps): llm.step()
    sync(llm.device)
    return (time.perf_counter() - t0) / steps * 1e3


def same_greedy_tokens(engines, num_prompts: int = 8, max_tokens: int = 40) -> bool:
    "The same greedy tokens from every engine (an iterable of `LLM`s) for the same `num_prompts` requests."
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(20 + 9 * i)] for i in range(num_prompts)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = [[o.token_ids for o in llm.generate(prompts, sp)] for llm in engines]
    return all(o == outs[0] for o in outs)


def decoding_engine(model_dir, batch: int, prompt_len: int = 1000, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                    **engine_kw):
    """A CPU engine with `batch` sequences of `prompt_len` tokens in steady decode, packed for the CUDA-graph buckets
    (`capture=False`: the static-buffer layout, no GPU), and `one()`: one decode step's host path (schedule,
    sampling rows, pack, update, reports) with no model forward. `engine_kw` go to `LLM`. Returns (llm, one)."""
    llm = LLM(model_dir, max_num_seqs=batch, max_num_batched_tokens=4096,
              num_kv_blocks=batch * (prompt_len // 16 + 72), device="cpu", **engine_kw)
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
        held = getattr(runner, "_table_update", None)      # what a launch commits (tables kept on the device)
        if held is not None: runner.graphs.held.commit(held)
        sched.update(step, [1] * len(step.sample_seq_ids)); llm._reports(step, 0.0)
        return x
    return llm, one


# ---- the engine experiments' shared pieces (graphs, mixed graphs, async scheduling, the overhead diet) -----------
def dtype_of(args) -> str:
    "The dtype the engine experiments run in: bf16 on the GPU; fp32 under --smoke (the interpreter has no bf16)."
    return "float32" if is_smoke(args) else "bfloat16"


def is_cuda(device=None) -> bool:
    "Whether `device` (default: the first GPU, when one is visible) is a CUDA device."
    return torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"


def free(device=None) -> None:
    "Give the CUDA allocator's cached memory back between engines (nothing to do on a CPU)."
    if is_cuda(device): torch.cuda.empty_cache()


def drain(llm) -> None:
    "Abort every request of `llm` and collect the step in flight (async scheduling): the engine idle."
    for i in list(llm._requests): llm.abort_request(i)
    while getattr(llm, "_inflight", None) is not None: llm.step()


def checkpoint(shape: str, args) -> tuple[Path, str]:
    """A folder of seeded random bf16 weights of the Qwen2.5 `shape` (`nanoserve.bench.random_checkpoint`: written
    once into the cache, a safetensors file like any other), and the shape's name; under --smoke the built-in tiny
    model and "tiny", whatever the shape."""
    if is_smoke(args): return tiny_model(), "tiny"
    return random_checkpoint(shape), shape


def model_config(model_dir) -> dict:
    "The checkpoint's config.json."
    return json.loads((Path(model_dir) / "config.json").read_text())


def agreeing_prefix(a, b) -> int:
    "How many leading tokens two sequences share."
    return next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), len(a))


def graph_replays(llm) -> tuple[int, int]:
    "Replays of the engine's decode graphs and mixed-step graphs so far (0 where there are none, as on a CPU)."
    g, m = llm.runner.graphs, llm.runner.mixed_graphs
    return (g.num_replays if g else 0), (m.num_replays if m else 0)


def copies_for_l2(nbytes: int, device=None) -> int:
    """Operand copies that make graph_bench's calls read >= 256 MB (five times the H200's L2), so that no call
    finds its weights cached; on a CPU (a smoke run) two, enough to exercise the indexing."""
    if not is_cuda(device): return 2
    return max(1, min(32, -(-(256 << 20) // max(nbytes, 1))))


def operand_copies(tensors, nbytes: int) -> list[tuple]:
    "The operands (a tuple; None stays None) and clones of them, `copies_for_l2(nbytes)` in all."
    device = next(t.device for t in tensors if t is not None)
    return [tuple(tensors)] + [tuple(None if t is None else t.clone() for t in tensors)
                               for _ in range(copies_for_l2(nbytes, device) - 1)]


def graph_bench(make_call, nbytes: int, passes: int = 2, replays: int = 10, device=None) -> list[float]:
    """Microseconds per call of `make_call(i)()` as a decode step sees it: calls over R copies of the operands
    (`copies_for_l2(nbytes)`: no call finds its weights in L2) captured in one CUDA graph, the graph replayed
    `replays` times per pass; one value per pass (no host launch time, no cache flush kernel). On a CPU (a smoke
    run: the code exercised, nothing measured) one pass only, the R calls back to back by the host's clock, with
    no warm-up round: under the interpreter every call costs the same, and the smoke runs stay short."""
    R = copies_for_l2(nbytes, device)
    calls = [make_call(i) for i in range(R)]
    if not is_cuda(device):
        t0 = time.perf_counter()
        for c in calls: c()
        return [(time.perf_counter() - t0) * 1e6 / R]
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


# ---- the quant experiments' shared pieces (quant_h200, quant_gemm_h200, quant_lab_h200, quant_pipe_h200) --------
def layer_shapes(shape: str, smoke: bool = False, tiny=(("down_proj", 256, 1024, False),)) -> list[tuple]:
    """(name, N out, K in, has bias) of a real model `shape`'s decoder layer linear layers (`SHAPES`, read by the
    model chapter's config: its head size and QKV bias; the fused qkv and gate/up projections, o and down); under
    --smoke the `tiny` ones instead."""
    if smoke: return list(tiny)
    from nanoserve.model import ModelConfig
    c = ModelConfig.from_dict(SHAPES[shape])
    h, inter, d = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    return [("qkv_proj", q + 2 * kv, h, c.attention_bias), ("o_proj", h, q, False),
            ("gate_up_proj", 2 * inter, h, False), ("down_proj", h, inter, False)]


def random_linear(N: int, K: int, bias: bool, device, dtype=torch.bfloat16, seed: int = 0) -> tuple:
    "A seeded linear layer's weight [N, K] and bias [N] (None without `bias`), normal values times 0.02."
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, device=device, dtype=dtype, generator=g) * 0.02
    b = torch.randn(N, device=device, dtype=dtype, generator=g) * 0.02 if bias else None
    return w, b


def tensor_bytes(tensors) -> int:
    "The bytes the tensors hold (None holds none): a quantized weight's words, scales and zero points."
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def max_rel_err(out, ref) -> float:
    "max |out - ref| / max |ref| in fp32: a kernel's error against its fp32 reference."
    ref = ref.float()
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def checked(err, what, tol: float = 0.02) -> None:
    "A kernel more than `tol` (2%) off its reference fails the run; `err` None (an ablation, wrong by design) passes."
    assert err is None or err < tol, (what, err)


def trial_row(cfg: dict, us: list[float], err, nbytes: int) -> dict:
    """One timed candidate of a kernel sweep: its config, its microseconds per pass (`graph_bench`), the faster one,
    its error against the reference (None: an ablation, wrong by design) and the GB/s of reading `nbytes` at that."""
    return {**cfg, "us": us, "best_us": min(us), "rel_err": err, "GBps": nbytes / min(us) / 1e3}


def best_trial(row: dict) -> list[dict]:
    """A sweep row's timed trials (those of its "trials" with "us"); when there are any, the fastest as row["best"],
    its speedup over the row's control "shipped_us" (where the row has one) and the worst error of the checked ones."""
    ok = [r for r in row["trials"] if "us" in r]
    if ok:
        row["best"] = min(ok, key=lambda r: r["best_us"])
        if "shipped_us" in row: row["speedup_vs_shipped"] = min(row["shipped_us"]) / row["best"]["best_us"]
        row["worst_rel_err"] = max(r["rel_err"] for r in ok if r["rel_err"] is not None)
    return ok


def step_ms_twice(llm, batch: int, steps: int, prompt_len: int = 128, warm_s: float = 1.0) -> tuple:
    """ms per `LLM.step()` in steady decode at `batch`: passes of `steps` back-to-back steps with one sync each (a
    per-step sync would drain the async pipeline), a warm-up pass that fills the pipeline, then two timed passes
    (`twice`): (first, second, disagree)."""
    steady_decode(llm, batch, prompt_len)
    warm(llm.device, warm_s)
    one_pass = lambda: median(time_wall(lambda: [llm.step() for _ in range(steps)], reps=1, warmup=0,
                                        device=llm.device)) / steps * 1e3
    one_pass()
    return twice(one_pass)


def exit_if_failed(res: dict) -> None:
    "Exit non-zero when a part failed (`saver` put its error in `res` under \"<part>_error\", and wrote it)."
    if any(k.endswith("_error") for k in res): raise SystemExit("a part failed (its error is in the JSON)")


def step_rates(model_dir, res, shape, batches, configs, key, steps=200, warm_s=1.0, dtype="bfloat16",
               prompt_len: int = 128) -> None:
    """ms per step over `steps` consecutive `LLM.step()` calls with one sync per pass (a per-call sync would drain
    the pipeline async scheduling builds), a warm-up pass then two timed passes, per (name, LLM kwargs) config;
    rows appended to res[key]."""
    rows = res.setdefault(key, [])
    for cname, kw in configs:
        llm = LLM(model_dir, dtype=dtype, num_kv_blocks={"0.5B": 16384, "7B": 4096}.get(shape, 512),
                  max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches)), **kw)
        for b in batches:
            steady_decode(llm, b, prompt_len)
            warm(llm.device, warm_s)
            times = []
            for _ in range(3):
                sync(llm.device); t0 = time.perf_counter()
                for _ in range(steps): llm.step()
                sync(llm.device); times.append((time.perf_counter() - t0) / steps * 1e3)
            row = {"shape": shape, "config": cname, "batch": b, "ms_per_step": times[1:], "warmup_ms": times[0],
                   "best_ms": min(times[1:]), "disagree": disagree(times[1], times[2])}
            print("rate", row, flush=True)
            rows.append(row)
        drain(llm)
        del llm; free()


def decode_row(llm, shape, cname, b, repeats, profiled_steps=16, ledger_steps=32, prompt_len=128) -> dict:
    """One steady-decode row of an engine at batch `b`: ms per `LLM.step()` (`step_ms_twice`: passes of `repeats`
    back-to-back steps, timed twice, >15% apart flagged), the step ledger's decode phases, device kernels per step
    and the GPU's busy share from one profiled window, the graphs' capture time and memory. (A sync after every
    step, as this row once timed it, drains the asynchronous pipeline: the families files' batch-1 rows read 15-25%
    above `step_ab_h200.py`'s back-to-back steps of the same shapes.)"""
    first, second, flagged = step_ms_twice(llm, b, repeats, prompt_len, warm_s=2.0)
    ctx = sum(r.seq.num_prompt_tokens + len(r.seq.output_token_ids) for r in llm._requests.values()) / b
    steady_decode(llm, b, prompt_len, seed=1)
    llm.ledger = StepLedger()
    for _ in range(ledger_steps): llm.step()
    ledger = llm.ledger.summary(decode_only=True); llm.ledger = None
    with profile_run(llm.device) as run:
        for _ in range(profiled_steps): llm.step()
    graphs = llm.runner.graphs
    mid = (first + second) / 2
    return {"shape": shape, "config": cname, "batch": b, "ms_per_step": [first, second], "mean_context": ctx,
            "median_ms": mid, "disagree": flagged, "tokens_per_s": b / (mid / 1e3),
            "kernels_per_step": count_device_kernels(run.events) / profiled_steps,
            "gpu_busy": busy_share(run) if is_cuda(llm.device) else None,
            "profiled_ms_per_step": run.wall_s / profiled_steps * 1e3, "ledger_decode": ledger,
            "graph_capture_s": graphs.capture_s if graphs else None,
            "graph_memory_mib": graphs.memory_bytes / 2**20 if graphs else None}


def decode_rows(model_dir, res, shape, configs: dict, batches, key, repeats=40, dtype="bfloat16", **row_kw) -> None:
    "Steady decode rows (`decode_row`) of each configuration (name -> LLM overrides) at each batch, into res[key]."
    for cname, kw in configs.items():
        llm = LLM(model_dir, dtype=dtype, num_kv_blocks={"0.5B": 32768, "7B": 8192}.get(shape, 512),
                  max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches)), show_progress=False,
                  **kw)
        for b in batches:
            row = decode_row(llm, shape, cname, b, repeats, **row_kw)
            print(key, {k: v for k, v in row.items() if k != "ledger_decode"}, flush=True)
            res.setdefault(key, []).append(row)
        drain(llm)
        del llm; free()


def floors(res, configs: dict, nbytes: int = 4 << 30) -> None:
    """Each res["decode"] row against its memory floor (`floor_rows`), over the copy bandwidth measured here
    (`configs`: shape name -> its config)."""
    bw, dis = copy_bandwidth_GBps(nbytes)
    res["copy_bandwidth_GBps"], res["copy_bandwidth_disagree"] = bw, dis
    floor_rows(res, configs)


def floor_rows(res, configs: dict) -> None:
    "Each res[\"decode\"] row's floor: weight bytes + K/V bytes over res[\"copy_bandwidth_GBps\"] (from `floors`)."
    for row in res.get("decode", []):
        cfg = configs[row["shape"]]
        fl = decode_floor_ms(model_weight_bytes(cfg), row["batch"] * row["mean_context"] * kv_bytes_per_token(cfg),
                             res["copy_bandwidth_GBps"])
        row["floor_ms"], row["x_floor"] = fl, row["median_ms"] / fl


def nanovllm_requests(vocab_size: int = 151936, max_model_len: int = 32768, num_requests: int = 256,
                      smoke: bool = False, seed: int = 0):
    """nano-vllm's workload: 256 requests, prompt and output lengths uniform in 100..1024, EOS ignored (under
    --smoke the first 8, their prompts cut to 16 tokens, 4 tokens out): (requests, sampling parameters)."""
    reqs = make_workload(WorkloadSpec(kind="nanovllm", num_requests=num_requests, seed=seed), vocab_size, max_model_len)
    if smoke: reqs = [type(r)(tuple(r.prompt_token_ids[:16]), 4) for r in reqs[:8]]
    return reqs, [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]


def timed_generate(llm, reqs, sp, repeats, label, warm_s: float = 3.0):
    "Warm the GPU, then time `generate` on all `reqs` `repeats` times: (tokens generated, seconds per run, outputs)."
    llm.generate([list(r.prompt_token_ids[:32]) for r in reqs[:8]], SamplingParams(max_tokens=8, ignore_eos=True))
    times = []
    for _ in range(repeats):
        warm(llm.device, warm_s)
        sync(llm.device); t0 = time.perf_counter()
        outs = llm.generate([list(r.prompt_token_ids) for r in reqs], sp)
        sync(llm.device); dt = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        assert n == sum(r.max_tokens for r in reqs), (n, sum(r.max_tokens for r in reqs))
        times.append(dt)
        print("nanovllm", label, n, f"{dt:.2f} s", f"{n / dt:,.0f} tok/s", flush=True)
    return n, times, outs


def nanovllm(model_dir, res, repeats=2, smoke: bool = False, dtype="bfloat16", **kw) -> None:
    "nano-vllm's workload on the engine's defaults (and `kw`), `repeats` timed runs, into res['nanovllm']."
    llm = LLM(model_dir, dtype=dtype, max_num_seqs=256, max_num_batched_tokens=16384,
              **({"num_kv_blocks": 512} if smoke else {}), **kw)
    reqs, sp = nanovllm_requests(llm.config.vocab_size, llm.max_model_len, smoke=smoke)
    n, times, _ = timed_generate(llm, reqs, sp, repeats, "defaults", warm_s=0.0 if smoke else 3.0)
    decode, mixed = graph_replays(llm)
    res["nanovllm"] = {"output_tokens": n, "seconds": times, "output_tokens_per_s": [n / t for t in times],
                       "disagree": disagree(times[0], times[-1]), "mixed_replays": mixed, "decode_replays": decode,
                       "num_kv_blocks": llm.num_kv_blocks, "max_num_seqs": 256, "max_num_batched_tokens": 16384}
    drain(llm)
    del llm; free()


def greedy_with_arrivals(model_dir, dtype, mixed: bool, **kw):
    """Twelve prompts through 6 slots: later prompts are admitted while others decode (mixed steps). Returns the
    greedy tokens and the (decode, mixed) graph replays."""
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=1024, max_num_seqs=6, max_num_batched_tokens=512,
              mixed_step_graphs=mixed, **kw)
    g = random.Random(3)
    prompts = [[g.randrange(llm.config.vocab_size) for _ in range(n)]
               for n in (7, 33, 64, 100, 130, 257, 9, 400, 50, 3, 77, 700)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
              for m in (40, 8, 25, 48, 12, 30, 44, 9, 20, 36, 16, 24)]
    toks = [o.token_ids for o in llm.generate(prompts, params)]
    replays = graph_replays(llm)
    drain(llm)
    del llm; free()
    return toks, replays


OFFLINE_SPEC = WorkloadSpec(kind="lognormal", num_requests=128, prompt_median=256, output_median=128, prompt_max=1024,
                            output_max=512)          # the benchmark chapter's workload (kernels/bench_h200.sh)
OFFLINE_COMMON = dict(dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=2048, num_kv_blocks=8192)
SMOKE_SPEC = WorkloadSpec(kind="lognormal", num_requests=6, prompt_median=16, output_median=4, prompt_max=32,
                          output_max=8)
SMOKE_COMMON = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=256, num_kv_blocks=256)


def offline(model_dir, res, configs, repeats=2, common=OFFLINE_COMMON, spec=OFFLINE_SPEC, timeout=400) -> None:
    """The benchmark chapter's offline workload, each configuration `configs` ((name, engine, LLM overrides): engine
    "continuous" or "static:N") `repeats` times, each run in a fresh process (`nanoserve.bench.run_benchmark`);
    res['offline'] (numerator: output tokens actually generated)."""
    rows = []
    for name, engine, extra in configs:
        reps = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = run_benchmark(model_dir, spec, [engine], engine_kwargs=common | extra, repeats=1, warmup_s=3.0,
                                timeout=timeout, progress=False, profile_steps=0)
            run = out["runs"][0]
            if "error" in run: raise RuntimeError(f"{name}: {run['error']}")
            r = run["reps"][0]
            s = r["summary"]
            reps.append({"summary": s, "ledger": r.get("ledger"), "ledger_decode": r.get("ledger_decode"),
                         "preemptions": r.get("preemptions"), "process_s": time.perf_counter() - t0})
            print("offline", name, {k: s[k] for k in ("output_tokens_per_s", "num_output_tokens") if k in s},
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        tps = [x["summary"]["output_tokens_per_s"] for x in reps]
        rows.append({"config": name, "engine": engine, "engine_kwargs": common | extra, "output_tokens_per_s": tps,
                     "disagree": max(tps) - min(tps) > FLAG * min(tps), "reps": reps})
        res["offline"] = {"workload": spec.__dict__, "numerator": "output tokens actually generated", "rows": rows}

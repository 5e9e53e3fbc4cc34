"""The host's share of a decode step, ours against nano-vllm's, side by side on one CPU, no model, no GPU.

    PYTHONPATH=. python kernels/host_vs_nanovllm.py --nanovllm DIR --out figures/data [--batch 256] [--rounds 7]

DIR is a checkout of nano-vllm (github.com/GeeeekExplorer/nano-vllm). Both sides hold `--batch` sequences in steady
decode at ~1,000-token contexts (prompts of 1,000 tokens, max_tokens far away, EOS ignored) and time one decode
step's host path with the model taken out:
- ours: `lab.decoding_engine`'s `one()`: schedule, sampling rows, pack into the CUDA-graph bucket's static layout,
  update, reports (the engine's own step less the forward pass and the device copy); in steady decode the
  scheduler's persistent batch makes each step from the last one's columns, and `nanoserve_full_pass`
  (`persistent_batch=False`) is the control: the step of a batch that changed (a sequence joined or left);
- nano-vllm's: its `Scheduler.schedule` + `ModelRunner.prepare_decode` + `prepare_sample` + `Scheduler.postprocess`,
  its own code read from DIR, with `pin_memory=True` and `.cuda(non_blocking=True)` taken out of the runner's
  methods (the device copies excluded, as on our side), at its default 256-token blocks and at our 16.
In the tutorials' order: check (every sequence advances one token a step on both sides), time (`--rounds`
interleaved rounds of 100 steps each; the ratio is ours over theirs, per round and as the median), count the
share of nano-vllm's workload's steps the persistent batch makes (`persistent_share`), write host_vs_nanovllm.json. Without `--nanovllm` only our side is timed. `--smoke`: batch 4, 64-token prompts, 2 rounds.
"""
import ast, random, sys, textwrap, timeit, types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import decoding_engine, is_smoke, median, meta, parser, tiny_model, write
from nanoserve.block_manager import CacheConfig
from nanoserve.scheduler import Request, SchedulerConfig, simulate


def load_nanovllm(root: Path):
    "nano-vllm's scheduler and sequence modules, and its runner's three host methods, read from its checkout `root`."
    pkg = root / "nanovllm"
    for name, path in (("nanovllm", pkg), ("nanovllm.engine", pkg / "engine"), ("nanovllm.utils", pkg / "utils")):
        mod = types.ModuleType(name); mod.__path__ = [str(path)]; sys.modules[name] = mod   # no package __init__
    config = types.ModuleType("nanovllm.config"); config.Config = object; sys.modules["nanovllm.config"] = config
    import importlib
    scheduler = importlib.import_module("nanovllm.engine.scheduler")
    sequence = importlib.import_module("nanovllm.engine.sequence")
    return scheduler, sequence, runner_methods(pkg / "engine" / "model_runner.py")


class _HostOnly(ast.NodeTransformer):
    "`torch.tensor(x, ..., pin_memory=True).cuda(non_blocking=True)` -> `torch.tensor(x, ...)`: no device copy."
    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "cuda": return node.func.value
        node.keywords = [k for k in node.keywords if k.arg != "pin_memory"]
        return node


def runner_methods(path: Path) -> type:
    "A class holding nano-vllm's `prepare_block_tables`, `prepare_decode` and `prepare_sample`, host-only."
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    keep = [f for f in cls.body if isinstance(f, ast.FunctionDef)
            and f.name in ("prepare_block_tables", "prepare_decode", "prepare_sample")]
    assert len(keep) == 3, [f.name for f in keep]
    for f in keep: f.decorator_list = []
    body = ast.Module(body=[ast.ClassDef("HostRunner", [], [], keep, [])], type_ignores=[])
    ns = {}
    exec("import torch\nfrom nanovllm.utils.context import set_context\nfrom nanovllm.engine.sequence import Sequence",
         ns)
    exec(compile(ast.fix_missing_locations(_HostOnly().visit(body)), str(path), "exec"), ns)
    return ns["HostRunner"]


def nanovllm_decoding(mods, batch: int, prompt_len: int, block_size: int):
    "nano-vllm's scheduler with `batch` sequences in steady decode, and `one()`: its decode step's host path."
    scheduler, sequence, Runner = mods
    sequence.Sequence.block_size = block_size
    cfg = types.SimpleNamespace(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len, eos=-1,
                                kvcache_block_size=block_size,
                                num_kvcache_blocks=batch * (prompt_len // block_size + 2 + 3000 // block_size))
    sched, runner = scheduler.Scheduler(cfg), Runner()
    runner.block_size, runner.rank = block_size, 0
    g = random.Random(0)
    params = types.SimpleNamespace(temperature=1.0, max_tokens=10 ** 6, ignore_eos=True)
    for _ in range(batch): sched.add(sequence.Sequence([g.randrange(151_000) for _ in range(prompt_len)], params))
    seqs, is_prefill = sched.schedule()                  # the whole prefill in one step
    assert is_prefill and len(seqs) == batch
    sched.postprocess(seqs, [1] * len(seqs), True)
    ones = [1] * batch

    def one():
        seqs, is_prefill = sched.schedule()
        runner.prepare_decode(seqs); runner.prepare_sample(seqs)
        sched.postprocess(seqs, ones, is_prefill)
        return seqs
    return sched, one


def check_ours(llm, one, batch: int) -> None:
    before = {s.seq_id: s.num_tokens for s in llm.scheduler.running}
    x = one()
    assert x.bucket == batch, (x.bucket, batch)
    assert all(s.num_tokens == before[s.seq_id] + 1 for s in llm.scheduler.running), "ours: a sequence did not advance"


def check_theirs(sched, one, batch: int) -> None:
    before = {s.seq_id: s.num_tokens for s in sched.running}
    seqs = one()
    assert len(seqs) == batch and all(s.num_tokens == before[s.seq_id] + 1 for s in seqs), "theirs: no advance"


def persistent_share(batch: int, smoke: bool) -> dict:
    """How many of the decode steps of nano-vllm's workload (`batch` requests, 100..1024 tokens in and out, all at
    once) the persistent batch makes (the rest are full passes: a sequence joined or left), from the scheduler
    and its fake model alone (16-token blocks, room for everything)."""
    g, hi = random.Random(0), (64 if smoke else 1024)
    reqs = [Request(i, [g.randrange(1000) for _ in range(g.randint(hi // 10, hi))], g.randint(hi // 10, hi))
            for i in range(batch)]
    res = simulate(reqs, SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=16384, max_model_len=2 * hi),
                   CacheConfig(num_blocks=batch * (2 * hi // 16 + 1), block_size=16))
    return {"persistent_steps": res.num_persistent_steps, "steps": res.num_steps,
            "share": res.num_persistent_steps / res.num_steps}


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--nanovllm", type=Path, help="a nano-vllm checkout (its nanovllm/ folder inside)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    smoke = is_smoke(args)
    batch, prompt_len, n, rounds = (4, 64, 5, 2) if smoke else (args.batch, 1000, 100, args.rounds)
    llm, ours = decoding_engine(tiny_model(), batch, prompt_len=prompt_len)
    check_ours(llm, ours, batch)
    full, ours_full = decoding_engine(tiny_model(), batch, prompt_len=prompt_len, persistent_batch=False)
    check_ours(full, ours_full, batch)
    sides = {"nanoserve": ours, "nanoserve_full_pass": ours_full}
    if args.nanovllm is not None:
        mods = load_nanovllm(args.nanovllm)
        for bs in (256, 16):
            sched, theirs = nanovllm_decoding(mods, batch, prompt_len, bs)
            check_theirs(sched, theirs, batch)
            sides[f"nanovllm_b{bs}"] = theirs
    ms = {k: [] for k in sides}
    for r in range(rounds):                              # interleaved; the order flips each round
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            ms[name].append(timeit.timeit(sides[name], number=n) / n * 1e3)
    row = {"meta": meta(), "batch": batch, "prompt_len": prompt_len, "steps_per_round": n, "ms_per_step": ms,
           "median_ms": {k: median(v) for k, v in ms.items()}}
    for name in sides:
        if name == "nanoserve": continue
        per_round = [a / b for a, b in zip(ms["nanoserve"], ms[name])]
        row[f"ratio_over_{name}"] = {"per_round": per_round, "median": median(per_round)}
    assert llm.scheduler.num_persistent_steps > 0 and full.scheduler.num_persistent_steps == 0
    row["workload_persistent_share"] = mix = persistent_share(batch, smoke)
    if "nanovllm_b256" in ms:            # nano-vllm's workload's mix of steps: persistent ones and full passes
        per_round = [(mix["share"] * a + (1 - mix["share"]) * b) / c
                     for a, b, c in zip(ms["nanoserve"], ms["nanoserve_full_pass"], ms["nanovllm_b256"])]
        row["ratio_over_nanovllm_b256_workload_mix"] = {"per_round": per_round, "median": median(per_round)}
    print({k: v for k, v in row.items() if k not in ("meta", "ms_per_step")})
    write("host_vs_nanovllm.json", {**row, "command": "PYTHONPATH=. python kernels/host_vs_nanovllm.py "
                                     "--nanovllm DIR --batch B", "target": "ours <= 0.7x nano-vllm's (256-token blocks)"},
          args)


if __name__ == "__main__":
    main()

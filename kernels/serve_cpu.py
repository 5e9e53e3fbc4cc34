"""The server's own cost per streamed token, on this CPU: how much of the server process's time each chunk takes.

    PYTHONPATH=. python kernels/serve_cpu.py --out figures/data [--streams 16] [--tokens 200] [--rounds 3]
        [--servers default,...] [--profile FILE.prof]

`nanoserve serve` on the built-in tiny model (the engine in its own process, the default), `--streams` streamed
completions at once of `--tokens` tokens each (greedy, EOS ignored), through httpx in this process. Measured:
the server process's CPU seconds over the run (user + system, from /proc, every thread of it; the engine's
process is another and is counted apart), the chunks and tokens the clients received, and so the server's CPU per
chunk. Every `--servers` variant (a name from `VARIANTS`: extra `nanoserve serve` options) runs in each round,
the order flipping each round. In the tutorials' order: check (every stream got its tokens, in order, once), time,
write serve_cpu.json. `--profile FILE`: one more run under cProfile (the server's main thread: the event loop),
its top functions by own time printed and the stats written to FILE. `--smoke`: 2 streams of 8 tokens, 1 round.
"""
import asyncio, json, os, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import is_smoke, median, meta, parser, tiny_model, write
from clients_h200 import start_server

import httpx

VARIANTS = {"default": ()}       # name -> extra `nanoserve serve` options
ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "num_kv_blocks": 2048}


def cpu_seconds(pid: int) -> float:
    "CPU seconds process `pid` has run so far, all its threads (the scheduler's nanosecond count, /proc/PID/task/*/schedstat)."
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try: total += int((task / "schedstat").read_text().split()[0])
        except OSError: pass                                    # a thread that ended meanwhile
    return total / 1e9


def children(pid: int) -> list[int]:
    "Processes whose parent is `pid` (the engine's process)."
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try: ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError: continue
            if ppid == pid: out.append(int(p.name))
    return out


async def one_stream(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> tuple[int, int]:
    "One streamed completion: (chunks, tokens) received."
    body = {"model": "clients", "prompt": f"def f{i}(x):", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks = text_chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]": continue
            chunks += 1
            event = json.loads(line[6:])
            text_chunks += sum(1 for c in event.get("choices", ()) if c.get("text") is not None)
    return chunks, text_chunks


async def run_streams(url: str, streams: int, tokens: int) -> list[tuple[int, int]]:
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(one_stream(client, url, i, tokens) for i in range(streams)))


def measure(pid: int, url: str, streams: int, tokens: int) -> dict:
    "One run: the server's and the engine's CPU seconds, the chunks, the wall time."
    engine_pids = children(pid)
    before = cpu_seconds(pid), sum(map(cpu_seconds, engine_pids))
    t0 = time.perf_counter()
    got = asyncio.run(run_streams(url, streams, tokens))
    wall = time.perf_counter() - t0
    server_s, engine_s = cpu_seconds(pid) - before[0], sum(map(cpu_seconds, engine_pids)) - before[1]
    num_chunks = sum(c for c, _ in got)
    assert all(c >= tokens for c, _ in got), f"a stream got fewer chunks than its {tokens} tokens: {got}"
    return {"wall_s": wall, "server_cpu_s": server_s, "engine_cpu_s": engine_s, "chunks": num_chunks,
            "server_cpu_us_per_chunk": server_s / num_chunks * 1e6, "engine_pids": len(engine_pids)}


def main():
    ap = parser(__doc__, out="figures/data")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", default="default", help="comma-separated names from VARIANTS")
    ap.add_argument("--profile", type=Path, default=None)
    args = ap.parse_args()
    streams, tokens, rounds = (2, 8, 1) if is_smoke(args) else (args.streams, args.tokens, args.rounds)
    names = args.servers.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown: ap.error(f"unknown --servers {unknown}; known: {sorted(VARIANTS)}")
    runs = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            log = Path(tempfile.mkdtemp(prefix="serve-cpu-")) / "server.log"
            proc, url = start_server(tiny_model(), ENGINE, "float32", "cpu", log, VARIANTS[name])
            try:
                measure(proc.pid, url, 2, 4)                                     # warm: compiles, first requests
                runs[name].append(measure(proc.pid, url, streams, tokens))
            finally:
                proc.terminate(); proc.wait(60)
            print(name, r, {k: round(v, 4) for k, v in runs[name][-1].items()}, flush=True)
    row = {"meta": meta(), "streams": streams, "tokens": tokens, "engine": ENGINE, "variants": {n: VARIANTS[n] for n in names},
           "runs": runs, "median_server_cpu_us_per_chunk": {n: median([x["server_cpu_us_per_chunk"] for x in v])
                                                             for n, v in runs.items()}}
    print(row["median_server_cpu_us_per_chunk"])
    if args.profile is not None: profile(args.profile, streams, tokens)
    write("serve_cpu.json", {**row, "command": "PYTHONPATH=. python kernels/serve_cpu.py --out DIR"}, args)


def profile(path: Path, streams: int, tokens: int) -> None:
    "One run of the default server under cProfile (its main thread, the event loop); the top of it printed."
    import pstats
    code = f"import cProfile; from nanoserve.server import main; cProfile.run('main()', {str(path)!r})"
    log = Path(tempfile.mkdtemp(prefix="serve-cpu-")) / "server.log"   # (the engine's process spawns from the module)
    proc, url = start_server(tiny_model(), ENGINE, "float32", "cpu", log, python_args=("-c", code))
    measure(proc.pid, url, 2, 4)
    measure(proc.pid, url, streams, tokens)
    proc.send_signal(2); proc.wait(120)
    pstats.Stats(str(path)).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

"""Issue 28's serving path on the H200: the engine in a process of its own (`nanoserve serve`'s default) against
the engine on a thread of the server's process (`--engine-in-thread`, the control), both against the engine alone;
both on uvicorn's asyncio loop and h11 parser, and, when uvloop and httptools are installed, the engine's process
with uvicorn's uvloop and httptools too.

Run on the device machine from the repo root (fastapi and uvicorn installed):
    NANOSERVE_GIT_SHA=<sha> PYTHONPATH=. python kernels/serve_process_h200.py --out $OUT [--rounds 3] [--servers process,thread]
        [--httpx-side]
Writes serve_process_h200.json (raw summaries, git sha, GPU, versions, date, the command) to --out.

The workload is the server chapter's: 128 lognormal requests (prompts median 256, outputs median 128, EOS
ignored), the 0.5B shape with random weights in bf16, 64 sequences at once. Both servers are started and warmed
first (unmeasured); then, round by round, each side runs the workload with Poisson arrivals at 12 requests/s (the
server issue's load) and with every request sent at once (saturated): the engine alone in a fresh process
(nanoserve.bench), then each server over streamed HTTP (nanoserve.endpoint), the order reversed every round.
Targets: time to first token p99 within 5 ms of the engine alone, output tokens/s within 5%, at 12 requests/s.
Each server's own histograms (`/metrics`), read before and after each run, split the client's mean time to first
token: the engine's (from submission to its first token), the HTTP side's (from the request's arrival at the
server to its first token's chunk written to the connection), and the rest (the client's own, and the wire).

The client is the benchmark's own (`nanoserve.endpoint.StreamClient`); `--httpx-side` sends the same runs to the
first server through httpx too (the client's control).

`--smoke`: the built-in tiny model on the CPU under the Triton interpreter, six requests, one round.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lab import (checkpoint, device_or_skip, dtype_of, exit_if_failed, is_smoke, median, parser, run_parts,  # noqa: E402
                 saver, warm)
from clients_h200 import POISSON_RATE, Settings, start_server                             # noqa: E402

import importlib.util, re, subprocess, tempfile, urllib.request                          # noqa: E402

from nanoserve.bench import model_limits, run_benchmark                                   # noqa: E402

from nanoserve.endpoint import endpoint_runner                                            # noqa: E402

ASYNCIO = ("--loop", "asyncio", "--http", "h11")      # uvicorn's pure-Python pair: the same on both controls
SERVERS = {"process": ASYNCIO, "thread": ("--engine-in-thread", *ASYNCIO)}
if importlib.util.find_spec("uvloop") and importlib.util.find_spec("httptools"):
    SERVERS["uvloop"] = ("--loop", "uvloop", "--http", "httptools")    # the engine's process, uvicorn's C pair


def stop(proc) -> None:
    proc.send_signal(2)
    try: proc.wait(60)
    except subprocess.TimeoutExpired: proc.kill(); proc.wait()


HISTOGRAMS = {"server_ttft": "nanoserve_time_to_first_token_seconds",            # submission -> the engine's first token
              "http_first_chunk": "nanoserve_http_time_to_first_chunk_seconds"}   # arrival -> its chunk written


def server_histograms(url: str) -> dict[str, tuple[float, int]]:
    "The server's own histograms (`HISTOGRAMS`, the HTTP side's where the server has it): name -> (sum, count)."
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for key, name in HISTOGRAMS.items():
        s, n = (re.search(rf"^{name}_{part} (\S+)$", text, re.M) for part in ("sum", "count"))
        if s and n: out[key] = float(s.group(1)), int(float(n.group(1)))
    return out


def one_run(model_dir, s: Settings, engine_kw: dict, http=None, rate: float | None = None, url: str | None = None) -> dict:
    """One run (the engine alone in a fresh process, or over HTTP): its summary, the client's mean time to first token
    and, for a server, the mean of its own over the same requests (the difference: HTTP before submission, delivery
    after the engine, and the client)."""
    before = server_histograms(url) if url else None
    out = run_benchmark(model_dir, s.spec, ["endpoint" if http else "continuous"], engine_kwargs=engine_kw,
                        rates=None if rate is None else [rate], repeats=1, warmup_s=3.0 if s.warm_s else 0.0,
                        progress=False, profile_steps=0, run_one=http, limits=model_limits(model_dir, engine_kw))
    run = out["runs"][0]
    if "error" in run: raise RuntimeError(run["error"])
    rep = run["reps"][0]
    ttfts = [r["ttft_s"] for r in rep["per_request"] if r.get("ttft_s") is not None]
    summary = rep["summary"] | {"ttft_mean_s": sum(ttfts) / len(ttfts)}
    if url:
        after = server_histograms(url)
        for key, (s0, n0) in before.items():
            s1, n1 = after[key]
            summary[key + "_mean_s"] = (s1 - s0) / max(1, n1 - n0)
    return summary


def summarize(runs: dict) -> dict:
    "Medians by side and load; each server against the engine alone (TTFT p99 in ms, throughput as a ratio)."
    med = {key: {m: median([r[m] for r in rs]) for m in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
                                                         "ttft_mean_s", "server_ttft_mean_s", "http_first_chunk_mean_s") if m in rs[0]}
           for key, rs in runs.items()}
    spread = {key: max(r["output_tokens_per_s"] for r in rs) / min(r["output_tokens_per_s"] for r in rs) - 1
              for key, rs in runs.items()}
    out = {"median": med, "tps_spread": spread, "disagree": {k: v > 0.15 for k, v in spread.items()}}
    names = [k for k in runs if not k.endswith("_poisson") and k != "engine"]      # the servers (and clients) timed
    for load in ("_poisson", ""):
        base = med["engine" + load]
        for name in names:
            m = med[name + load]
            out[name + load] = {"ttft_p99_over_engine_ms": (m["ttft_p99_s"] - base["ttft_p99_s"]) * 1e3,
                                "ttft_p50_over_engine_ms": (m["ttft_p50_s"] - base["ttft_p50_s"]) * 1e3,
                                "tps_ratio": m["output_tokens_per_s"] / base["output_tokens_per_s"]}
    out["targets"] = {"ttft_p99_within_ms": 5.0, "tps_within": 0.05,
                      "met": {name: out[name + "_poisson"]["ttft_p99_over_engine_ms"] <= 5.0 and
                              out[name + "_poisson"]["tps_ratio"] >= 0.95 for name in names}}
    return out


def serve_ab(model_dir, s: Settings, res: dict, dtype: str, device, rounds: int, httpx_side: bool = False) -> None:
    engine_kw = dict(s.server_engine, dtype=dtype, device=device.type)
    folder, servers = Path(tempfile.mkdtemp(prefix="serve-process-")), {}
    try:
        for name, extra in SERVERS.items():
            servers[name] = start_server(model_dir, s.server_engine, dtype, device.type, folder / f"{name}.log", extra)
        urls = {name: url for name, (_, url) in servers.items()}
        http = {name: endpoint_runner({"url": url, "model": "clients"}) for name, url in urls.items()}
        for name in SERVERS: one_run(model_dir, s, engine_kw, http[name])          # warm each server, unmeasured
        runs, sides = {}, ["engine", *SERVERS]
        if httpx_side:        # the first server again, through httpx instead of the benchmark's own client
            first = next(iter(SERVERS))
            urls[first + "_httpx"] = urls[first]
            http[first + "_httpx"] = endpoint_runner({"url": urls[first], "model": "clients", "http_client": "httpx"})
            sides.append(first + "_httpx")
        for r in range(rounds):
            for name in (sides if r % 2 == 0 else sides[::-1]):
                for rate, key in ((POISSON_RATE, name + "_poisson"), (None, name)):
                    warm(device, 1.0)                                          # the clocks up before every row
                    summary = one_run(model_dir, s, engine_kw, http.get(name), rate, urls.get(name))
                    runs.setdefault(key, []).append(summary)
                    print("serve", r, key, {k: round(v, 4) for k, v in summary.items() if k in (
                        "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "server_ttft_mean_s",
                        "http_first_chunk_mean_s")}, flush=True)
    finally:
        for proc, _ in servers.values(): stop(proc)
    res["serve_process"] = {"workload": s.spec.__dict__, "engine_kwargs": engine_kw, "poisson_rate": POISSON_RATE,
                            "rounds": rounds, "runs": runs, **summarize(runs),
                            "server_logs": {n: (folder / f"{n}.log").read_text()[-1500:] for n in SERVERS}}
    print({k: v for k, v in res["serve_process"].items() if k not in ("runs", "server_logs", "median", "workload")})


def main():
    ap = parser(__doc__, parts="serve")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of: {','.join(SERVERS)}")
    ap.add_argument("--httpx-side", action="store_true", help="the first server through httpx too (the client's control)")
    args = ap.parse_args()
    for name in set(SERVERS) - set(args.servers.split(",")): del SERVERS[name]
    device = device_or_skip(args)
    smoke, dtype = is_smoke(args), dtype_of(args)
    s = Settings(smoke)
    model_dir, shape = checkpoint("0.5B", args)
    res = {"shape": shape, "dtype": dtype, "device": str(device)}
    rounds = 1 if smoke else args.rounds
    parts = {"serve": lambda: serve_ab(model_dir, s, res, dtype, device, rounds, args.httpx_side)}
    run_parts(parts, args.parts, saver("serve_process_h200.json", res, args), res.setdefault("part_seconds", {}))
    exit_if_failed(res)


if __name__ == "__main__":
    main()

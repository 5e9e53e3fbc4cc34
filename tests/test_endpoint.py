"""nanoserve.endpoint against real HTTP servers on loopback: `python -m nanoserve.server` with the built-in tiny
model (a short Poisson run, tokens counted exactly; a wrong API key), and tiny asyncio servers that drop or garble
streams. Every failure must be an error on its request, never an exception out of `run_endpoint`."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nanoserve.bench import BenchRequest, WorkloadSpec, make_workload, poisson_send_times, summarize
from nanoserve.endpoint import run_endpoint, parse_sse_line, chunk_info
from nanoserve.tokenizer import TINY_MODEL_NAME, build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
KEY = "endpoint-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("nanoserve-cache")
    log = cache / "server.log"
    env = {**os.environ, "NANOSERVE_CACHE": str(cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("NANOSERVE_API_KEY", None)
    with open(log, "w") as f:
        tiny = build_tiny_model(cache / TINY_MODEL_NAME)       # the random tiny model: fast, not the trained default
        proc = subprocess.Popen([sys.executable, "-m", "nanoserve.server", "--model", str(tiny), "--port", "0", "--no-access-log",
                                 "--log-level", "warning", "--api-key", KEY, "--max-num-seqs", "32"],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 180
        while not (m := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill(); proc.wait()
                pytest.fail(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.1)
        yield m.group(1)
        proc.send_signal(signal.SIGINT)
        try: assert proc.wait(30) == 0, log.read_text()
        except subprocess.TimeoutExpired: proc.kill(); proc.wait(); raise
    assert "Traceback" not in log.read_text(), log.read_text()


def workload(n=16, out=8):
    spec = WorkloadSpec(num_requests=n, prompt_median=32, prompt_max=128, output_min=out, output_max=out)
    return make_workload(spec, vocab_size=3072, max_model_len=2048)


def test_parsing():
    assert parse_sse_line("") is None and parse_sse_line("event: x") is None
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    assert chunk_info({"choices": [{"text": "a", "finish_reason": "length"}]})["finish_reason"] == "length"
    assert chunk_info({"choices": [], "usage": {"completion_tokens": 3}})["completion_tokens"] == 3


def test_poisson_run_counts_tokens_exactly(server):
    reqs = workload()
    send = poisson_send_times(len(reqs), 8.0, seed=0)
    res = run_endpoint(server, reqs, send, api_key=KEY)
    assert res["errors"] == 0, [r.get("error") for r in res["per_request"]]
    per = res["per_request"]
    assert [r["num_output_tokens"] for r in per] == [8] * 16
    assert [r["send_s"] for r in per] == send
    for r in per:
        assert 0 < r["ttft_s"] <= r["e2e_s"] < 30 and all(g >= 0 for g in r["itl_s"])
    assert res["server"]["name"] == "nanoserve" and res["server"]["model"] and res["server"]["version"]
    s = summarize(per, res["wall_s"])
    assert s["output_tokens"] == 128 and s["ttft_p50_s"] is not None and s["tpot_p50_s"] is not None
    assert res["wall_s"] >= max(send)
    c = res["client"]                                    # the client kept up at this rate
    # a client that waited for answers before sending would lag by seconds; the server shares this machine's two
    # cores, so one late wake-up of the client's loop is allowed a quarter of a second
    assert c["send_lag_max_s"] < 0.25 and c["send_lag_p50_s"] < 0.02, c
    assert 0 < c["cpu_s_per_request"] < 0.1, c


def test_offline_burst_and_explicit_model(server):
    reqs = workload(n=24, out=4)
    res = run_endpoint(server, reqs, None, api_key=KEY, model=run_endpoint(server, reqs[:1], None, api_key=KEY)["server"]["model"])
    assert res["errors"] == 0 and sum(r["num_output_tokens"] for r in res["per_request"]) == 96


@pytest.mark.parametrize("http_client", ["lean", "httpx"])
def test_both_clients_count_every_token_under_a_connection_limit(server, http_client):
    "The benchmark's client and httpx: 24 requests at once, at most 3 in flight (max_connections), every token counted."
    reqs = workload(n=24, out=4)
    res = run_endpoint(server, reqs, None, api_key=KEY, max_connections=3, http_client=http_client)
    assert res["errors"] == 0 and res["server"]["http_client"] == http_client
    assert [r["num_output_tokens"] for r in res["per_request"]] == [4] * 24


def test_wrong_key_is_errors_not_a_crash(server):
    reqs = workload(n=6)
    res = run_endpoint(server, reqs, [0.01 * i for i in range(6)], api_key="wrong")
    assert res["errors"] == 6 and "models_error" in res["server"]
    assert all(r["error"].startswith("HTTP 401") and r["num_output_tokens"] == 0 and r["ttft_s"] is None
               for r in res["per_request"])
    assert summarize(res["per_request"], res["wall_s"])["output_tokens"] == 0


def test_unknown_model(server):
    reqs = workload(n=2)
    res = run_endpoint(server, reqs, None, api_key=KEY, model="no-such-model")
    assert res["errors"] == 2 and all(r["error"].startswith("HTTP 404") for r in res["per_request"])


class FakeServer:
    """A tiny asyncio HTTP server on loopback whose answers to /v1/completions are chosen by `mode`. It closes every
    connection after one answer and says so (`connection: close`): otherwise the client may reuse a pooled connection
    the server has just closed, and the request fails with a ReadError instead of the error under test."""

    def __init__(self, mode: str):
        self.mode, self.loop = mode, asyncio.new_event_loop()
        ready = threading.Event()
        def run():
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self.handle, "127.0.0.1", 0))
            ready.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=run, daemon=True); self.thread.start(); ready.wait(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1)) if b"content-length" in head.lower() else 0
            if n: await reader.readexactly(n)
            if not head.startswith(b"POST /v1/completions"):
                body = b'{"object": "list", "data": [{"id": "fake", "owned_by": "fake"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain(); return
            if self.mode == "close": return                          # no answer at all
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            def chunk(s: bytes): writer.write(b"%x\r\n%s\r\n" % (len(s), s))
            chunk(b'data: {"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}\n\n')
            if self.mode == "wrong_count":
                chunk(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}\n\n')
                chunk(b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n')
                chunk(b"data: [DONE]\n\n"); chunk(b"")
            elif self.mode == "error_event":
                chunk(b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n')
                chunk(b"data: [DONE]\n\n"); chunk(b"")
            elif self.mode == "no_done":                             # a clean end of the body, but no [DONE]
                chunk(b"")
            await writer.drain()                                     # "drop": close in the middle of the body
        except Exception: pass
        finally:
            writer.close()

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop); self.thread.join(5)


BROKEN = {"close": {"httpx": "RemoteProtocolError", "lean": "closed the connection without answering"},
          "drop": {"httpx": "RemoteProtocolError", "lean": "in the middle of the body"},
          "no_done": "without [DONE]", "error_event": "engine died", "wrong_count": "generated 1 tokens"}


@pytest.mark.parametrize("http_client", ["lean", "httpx"])
@pytest.mark.parametrize("mode", list(BROKEN))
def test_broken_streams_are_errors(mode, http_client):
    "Both clients (the benchmark's own and httpx) make every broken stream an error of its request, named."
    expect = BROKEN[mode] if isinstance(BROKEN[mode], str) else BROKEN[mode][http_client]
    fake = FakeServer(mode)
    try:
        reqs = [BenchRequest((1, 2, 3), 4)] * 5
        res = run_endpoint(fake.url, reqs, [0.005 * i for i in range(5)], timeout=10, http_client=http_client)
    finally:
        fake.stop()
    assert res["server"]["model"] == "fake" and res["errors"] == 5
    for r in res["per_request"]:
        assert expect in r["error"] and r["num_output_tokens"] == 0 and r["e2e_s"] is None, r["error"]


def test_connection_refused_is_errors():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    res = run_endpoint(f"http://127.0.0.1:{port}", [BenchRequest((1,), 2)] * 3, None, model="m", timeout=5)
    assert res["errors"] == 3 and all("ConnectError" in r["error"] for r in res["per_request"])


def test_killed_server_mid_run(tmp_path):
    "A real server killed while streams are open: the open streams and later requests become errors."
    env = {**os.environ, "NANOSERVE_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("NANOSERVE_API_KEY", None)
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        tiny = build_tiny_model(tmp_path / TINY_MODEL_NAME)       # the random tiny model: fast, not the trained default
        proc = subprocess.Popen([sys.executable, "-m", "nanoserve.server", "--model", str(tiny), "--port", "0", "--no-access-log",
                                 "--log-level", "warning", "--max-num-seqs", "4"], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while not (m := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        reqs = workload(n=8, out=1000)
        threading.Timer(1.0, proc.kill).start()
        res = run_endpoint(m.group(1), reqs, [0.1 * i for i in range(8)], timeout=20)
    finally:
        if proc.poll() is None: proc.kill()
        proc.wait()
    errors = [r.get("error") or "" for r in res["per_request"]]
    assert res["errors"] == 8, errors
    cut = ("RemoteProtocolError", "ReadError", "in the middle of the body")                # httpx's words, or ours
    assert any(any(c in e for c in cut) for e in errors), errors                        # a stream cut off mid-way


def test_nanoserve_bench_endpoint_cli(server, tmp_path):
    "`nanoserve bench --endpoint`: the same workload over HTTP, twice, into the usual results JSON."
    import json
    from nanoserve.bench import report
    from nanoserve.cli import main          # the command line hands `bench --endpoint` to the endpoint chapter
    out = tmp_path / "endpoint.json"
    rc = main(["bench", "--endpoint", server, "--api-key", KEY, "--model", "tiny-qwen2-v1", "--num-requests", "6", "--prompt-median", "16",
               "--prompt-max", "64", "--output-median", "4", "--output-max", "6", "--rate", "20",
               "--vocab-size", "3072", "--max-model-len", "2048", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    (run,) = res["runs"]
    assert run["engine"] == f"endpoint:{server}" and len(run["reps"]) == 2
    for rep in run["reps"]:
        assert rep["errors"] == 0
        assert rep["summary"]["output_tokens"] == res["num_output_tokens_requested"]
        assert rep["server"]["name"] == "nanoserve"
    assert "endpoint:" in report(res)


@pytest.mark.parametrize("mode", ["refused", "all_fail"])
def test_nanoserve_bench_dead_endpoint_says_so_and_exits_nonzero(mode, tmp_path, capsys):
    """A dead endpoint (connection refused), or one whose every request fails: the command says so and exits
    non-zero, with no '0 tok/s' and no nan in the table. It printed both and exited 0."""
    from nanoserve.cli import main
    fake = None
    if mode == "refused":
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); url = f"http://127.0.0.1:{s.getsockname()[1]}"
    else:
        fake = FakeServer("close"); url = fake.url
    out = tmp_path / "res.json"
    try:
        rc = main(["bench", "--endpoint", url, "--model", "m", "--num-requests", "3", "--prompt-median", "8",
                   "--prompt-max", "16", "--output-median", "2", "--output-max", "4", "--vocab-size", "3072",
                   "--repeats", "2", "--out", str(out)])
    finally:
        if fake is not None: fake.stop()
    cap = capsys.readouterr()
    assert rc == 1, (rc, cap.out, cap.err)
    table = "\n".join(l for l in cap.out.lower().splitlines() if not l.startswith(("results:", "workload:")))
    assert not re.search(r"\bnan\b", table) and not re.search(r"\s0\s", table), cap.out
    (line,) = [l for l in cap.out.splitlines() if "FAILED" in l]
    want = "no server answers at" if mode == "refused" else "all 3 requests failed"
    assert want in line and want in cap.err, (line, cap.err)
    res = json.loads(out.read_text())
    (run,) = res["runs"]
    assert "reps" not in run and want in run["error"] and res["complete"] is True

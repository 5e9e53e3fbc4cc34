"""nanoserve.server over real HTTP: server processes on free loopback ports (`--port 0`, the address read from the
line the server prints), the built-in tiny model built into a NANOSERVE_CACHE made for this module.

Four servers, each shaped for its tests:
- `server`: the API key from NANOSERVE_API_KEY, 256 sequences at once, a 64 KiB body limit. The official `openai`
  client (sync and async, completions and chat, streamed and not), 1,000 concurrent streams, disconnects, and
  every bad input with its status and message.
- `fuzz_server`: no API key, a 128-token context so that everything schemathesis sends finishes in milliseconds.
- `small_server` (started with the `nanoserve serve` console script, key from --api-key): one sequence at once
  and one waiting, for the full queue (503) and a shutdown with requests in flight.
- `edge_server`: 4 sequences at once and 5 waiting (9 of 30 simultaneous requests taken), a 1 s body timeout, the
  engine on a thread of the server's process (`--engine-in-thread`, the control); the other three run it in a
  process of its own, the default.

The server processes run torch on one thread (OMP_NUM_THREADS=1): the model is tiny, and the test process
needs the second core for its clients.
"""
from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve.tokenizer import TINY_MODEL_NAME, build_tiny_model

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 2048                     # the built-in tiny model's context
BODY_LIMIT = 65536


class ServerProcess:
    "A server in a child process; `url` once it has printed its address."

    def __init__(self, cmd: list[str], log: Path, env: dict):
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 180
        while True:
            m = re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)", log.read_text())
            if m: break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.1)
        self.url = m.group(1)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("nanoserve-cache")
    e = {**os.environ, "NANOSERVE_CACHE": str(cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    e.pop("NANOSERVE_API_KEY", None)
    # the servers under test serve the random tiny model (fast: 2 layers of 64), not the trained default
    e["NANOSERVE_TEST_MODEL"] = str(build_tiny_model(cache / TINY_MODEL_NAME))
    return e


def start(tmp_path_factory, env, name, args, cmd=None, extra_env=None) -> ServerProcess:
    cmd = cmd or [sys.executable, "-m", "nanoserve.server"]
    log = tmp_path_factory.mktemp(name) / "server.log"
    return ServerProcess([*cmd, "--port", "0", "--no-access-log", "--log-level", "warning",
                          "--model", env["NANOSERVE_TEST_MODEL"], *args], log, {**env, **(extra_env or {})})


@pytest.fixture(scope="module")
def server(tmp_path_factory, env):
    s = start(tmp_path_factory, env, "main", ["--served-model-name", "tiny", "--max-num-seqs", "256",
                                             "--max-waiting", "4000", "--max-body-bytes", str(BODY_LIMIT)],
              extra_env={"NANOSERVE_API_KEY": KEY})
    yield s
    assert s.stop() == 0, s.log.read_text()
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def metrics(url: str) -> dict[str, float]:
    "The samples of /metrics (bucket lines left out), by name with labels."
    text = httpx.get(url + "/metrics").text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line and not line.startswith("#") and "_bucket" not in line)}


def sse_events(lines) -> list:
    "Parsed `data:` events of a stream; '[DONE]' stays a string."
    out = []
    for line in lines:
        if not line: continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def greedy(**extra) -> dict:
    return {"temperature": 0, **extra}


# --- the routes that are not generation ----------------------------------------------------------------------

def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}       # no key needed
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("nanoserve_requests_running", "nanoserve_requests_waiting", "nanoserve_kv_blocks_used",
                 "nanoserve_kv_blocks_total", "nanoserve_prefix_cache_hit_rate", "nanoserve_prompt_tokens_total",
                 "nanoserve_generation_tokens_total", "nanoserve_preemptions_total",
                 "nanoserve_time_to_first_token_seconds", "nanoserve_time_per_output_token_seconds",
                 "nanoserve_e2e_request_latency_seconds"):
        assert f"# TYPE {name} " in r.text, name
    assert 'nanoserve_time_to_first_token_seconds_bucket{le="+Inf"}' in r.text


def test_openapi_documents_400_not_422(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "503"} <= set(responses) and "422" not in responses
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == ["tiny"]
    assert "/v1/models/{model_id}" in schema["paths"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "ChatMessage", "ResponseFormat", "Tool"):
        assert schema["components"]["schemas"][name]["additionalProperties"] is False, name   # unknown fields: 400
    chat_props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in ("user", "metadata", "store", "service_tier", "prediction"):
        assert "ignored" in chat_props[name]["description"], name
    assert (chat_props["functions"]["type"], chat_props["functions"]["description"]) == (
        "null", "refused when set: deprecated, send tools")


# --- the official openai client -----------------------------------------------------------------------------

def test_openai_sync_completions(client):
    kw = dict(model="tiny", prompt="Hello, world!", max_tokens=6, extra_body={"ignore_eos": True}, **greedy())
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert (whole.usage.completion_tokens, whole.usage.total_tokens) == (6, whole.usage.prompt_tokens + 6)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    # seeded sampling is reproducible; token ids as the prompt
    seeded = dict(model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**seeded), client.completions.create(**seeded)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == 3


def test_openai_sync_chat(client):
    kw = dict(model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
              max_tokens=5, extra_body={"ignore_eos": True}, **greedy())
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 5 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)
    # max_completion_tokens, and text parts as content
    parts = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hi!"}]}], max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert parts.usage.completion_tokens == 3


def test_openai_async_all_four(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
            extra = {"ignore_eos": True}
            comp = c.completions.create(model="tiny", prompt="A request", max_tokens=4, extra_body=extra)
            chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                             extra_body=extra)

            async def comp_stream():
                s = await c.completions.create(model="tiny", prompt="A request", max_tokens=4, stream=True,
                                               stream_options={"include_usage": True}, extra_body=extra)
                return [x async for x in s]

            async def chat_stream():
                s = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4, stream=True, stream_options={"include_usage": True},
                                                    extra_body=extra)
                return [x async for x in s]
            return await asyncio.gather(comp, chat, comp_stream(), chat_stream())

    comp, chat, comp_chunks, chat_chunks = asyncio.run(run())
    assert comp.usage.completion_tokens == chat.usage.completion_tokens == 4
    assert comp_chunks[-1].usage.completion_tokens == chat_chunks[-1].usage.completion_tokens == 4
    assert chat_chunks[-2].choices[0].finish_reason == comp_chunks[-2].choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_before_it(client):
    text = client.completions.create(model="tiny", prompt="The server", max_tokens=12, extra_body={"ignore_eos": True},
                                     **greedy()).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if len(text) < 4 or not stop.strip():
        pytest.skip(f"the random model's text {text!r} has no usable stop string")
    out = client.completions.create(model="tiny", prompt="The server", max_tokens=12, stop=[stop],
                                    extra_body={"ignore_eos": True}, **greedy())
    assert out.choices[0].text == text[:text.index(stop)] and out.choices[0].finish_reason == "stop"


# --- load ------------------------------------------------------------------------------------------------------

def test_1000_concurrent_streams_each_get_exactly_max_tokens(server):
    n, max_tokens = 1000, 4
    before = metrics(server.url)

    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": "tiny", "prompt": f"request number {i}", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            return sse_events([line async for line in r.aiter_lines()])

    async def run():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, limits=limits, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)), return_exceptions=True)

    t0 = time.perf_counter()
    results = asyncio.run(run())
    elapsed = time.perf_counter() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} requests failed, e.g. {errors[:3]!r}"
    for events in results:
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert events[-2]["usage"]["completion_tokens"] == max_tokens
        reasons = [e["choices"][0]["finish_reason"] for e in events[:-2]]
        assert reasons[-1] == "length" and reasons.count("length") == 1
    after = metrics(server.url)
    assert after['nanoserve_requests_finished_total{finish_reason="length"}'] \
        - before['nanoserve_requests_finished_total{finish_reason="length"}'] == n
    assert after["nanoserve_generation_tokens_total"] - before["nanoserve_generation_tokens_total"] == n * max_tokens
    assert after["nanoserve_kv_blocks_used"] == after["nanoserve_requests_running"] == 0
    first = "nanoserve_http_time_to_first_chunk_seconds"          # the HTTP side's own histogram: one per stream
    assert after[first + "_count"] - before[first + "_count"] == n and after[first + "_sum"] > before[first + "_sum"]
    print(f"{n} concurrent streams in {elapsed:.1f} s")


# --- disconnects -----------------------------------------------------------------------------------------------

def wait_for_blocks_freed(url: str, aborts_before: float) -> float:
    "Seconds until /metrics shows no KV block in use and one more aborted request (fails after 5 s)."
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 5:
        m = metrics(url)
        if m["nanoserve_kv_blocks_used"] == 0 and m['nanoserve_requests_finished_total{finish_reason="abort"}'] > aborts_before:
            return time.perf_counter() - t0
        time.sleep(0.02)
    pytest.fail(f"blocks still in use 5 s after the disconnect: {m}")


def test_stream_disconnect_frees_blocks_within_a_second(server):
    body = {"model": "tiny", "prompt": "A long answer", "max_tokens": CONTEXT - 16, "ignore_eos": True, "stream": True}
    aborts = metrics(server.url)['nanoserve_requests_finished_total{finish_reason="abort"}']
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(3): next(line for line in lines if line)
            m = metrics(server.url)
            assert m["nanoserve_kv_blocks_used"] > 0 and m["nanoserve_requests_running"] == 1
    # leaving both blocks closed the connection mid-stream
    assert wait_for_blocks_freed(server.url, aborts) < 1.0


def test_non_streaming_disconnect_frees_blocks_within_a_second(server):
    body = {"model": "tiny", "prompt": [1], "max_tokens": CONTEXT - 8, "ignore_eos": True}
    aborts = metrics(server.url)['nanoserve_requests_finished_total{finish_reason="abort"}']
    with pytest.raises(httpx.ReadTimeout):                 # the client gives up and hangs up
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
    assert wait_for_blocks_freed(server.url, aborts) < 1.0


# --- bad input -------------------------------------------------------------------------------------------------

def comp(**kw):
    return {"model": "tiny", "prompt": "Hello", **kw}


def chat(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], **kw}


# (name, path, body: dict or raw bytes, extra headers, status, words the message must contain, param)
BAD = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', {}, 400, "not valid JSON", None),
    ("JSON that is not an object", "/v1/completions", b"[1, 2]", {}, 400, "JSON object", None),
    ("not JSON at all", "/v1/completions", b"model=tiny", {"Content-Type": "text/plain"}, 400, "Content-Type", None),
    ("no body", "/v1/chat/completions", b"", {}, 400, "JSON object", None),
    ("missing model", "/v1/completions", {"prompt": "x"}, {}, 400, "'model' is required", "model"),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, {}, 400, "'prompt' is required", "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, {}, 400, "'messages' is required", "messages"),
    ("empty messages", "/v1/chat/completions", chat(messages=[]), {}, 400, "messages", "messages"),
    ("missing content", "/v1/chat/completions", chat(messages=[{"role": "user"}]), {}, 400,
     "'messages[0].content' is required", "messages"),
    ("unknown role", "/v1/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]), {}, 400,
     "messages[0].role", "messages"),
    ("image content", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), {}, 400,
     "messages[0].content", "messages"),
    ("max_tokens as a string", "/v1/completions", comp(max_tokens="5"), {}, 400, "max_tokens", "max_tokens"),
    ("max_tokens not whole", "/v1/completions", comp(max_tokens=2.5), {}, 400, "max_tokens", "max_tokens"),
    ("max_tokens 0", "/v1/completions", comp(max_tokens=0), {}, 400, "max_tokens", "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions", chat(max_tokens=-3), {}, 400, "max_tokens", "max_tokens"),
    ("max_tokens beyond the context", "/v1/completions", comp(max_tokens=CONTEXT), {}, 400, "context", "max_tokens"),
    ("max_completion_tokens beyond the context", "/v1/chat/completions", chat(max_completion_tokens=CONTEXT), {}, 400,
     "max_completion_tokens", "max_completion_tokens"),
    ("prompt over the context", "/v1/completions", comp(prompt=[1] * CONTEXT), {}, 400, "2048 tokens", "prompt"),
    ("conversation over the context", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": " the" * 3000}]), {}, 400, "context", "messages"),
    ("prompt of the wrong type", "/v1/completions", comp(prompt=5), {}, 400, "string or a list of token ids", "prompt"),
    ("token id outside the vocabulary", "/v1/completions", comp(prompt=[1, 10**9]), {}, 400, "[0, ", "prompt"),
    ("negative token id", "/v1/completions", comp(prompt=[1, -1]), {}, 400, "prompt", "prompt"),
    ("empty prompt", "/v1/completions", comp(prompt=""), {}, 400, "empty", "prompt"),
    ("empty prompt in a batch", "/v1/completions", comp(prompt=["a", ""]), {}, 400, "prompt[1] is empty", "prompt"),
    ("temperature as a string", "/v1/completions", comp(temperature="hot"), {}, 400, "temperature", "temperature"),
    ("temperature NaN", "/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', {}, 400,
     "finite", "temperature"),
    ("negative temperature", "/v1/chat/completions", chat(temperature=-1), {}, 400, "temperature", "temperature"),
    ("top_p 0", "/v1/completions", comp(top_p=0), {}, 400, "top_p", "top_p"),
    ("top_p above 1", "/v1/completions", comp(top_p=1.5), {}, 400, "top_p", "top_p"),
    ("top_k below -1", "/v1/completions", comp(top_k=-2), {}, 400, "top_k", "top_k"),
    ("seed not whole", "/v1/completions", comp(seed=1.5), {}, 400, "seed", "seed"),
    ("stream as a string", "/v1/completions", comp(stream="yes"), {}, 400, "stream", "stream"),
    ("empty stop string", "/v1/completions", comp(stop=[""]), {}, 400, "stop", "stop"),
    ("stream_options without stream", "/v1/completions", comp(stream_options={"include_usage": True}), {}, 400,
     "stream_options", "stream_options"),
    ("n over the schema's limit", "/v1/completions", comp(n=1000), {}, 400, "less than or equal to 128", "n"),
    ("logprobs over 5", "/v1/completions", comp(logprobs=6), {}, 400, "logprobs", "logprobs"),
    ("top_logprobs over 20", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs",
     "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=2), {}, 400, "needs logprobs",
     "top_logprobs"),
    ("penalty out of range", "/v1/chat/completions", chat(presence_penalty=2.5), {}, 400, "presence_penalty",
     "presence_penalty"),
    ("repetition_penalty 0", "/v1/completions", comp(repetition_penalty=0), {}, 400, "repetition_penalty",
     "repetition_penalty"),
    ("min_p above 1", "/v1/completions", comp(min_p=1.5), {}, 400, "min_p", "min_p"),
    ("min_tokens over max_tokens", "/v1/completions", comp(min_tokens=9, max_tokens=4), {}, 400, "min_tokens",
     "min_tokens"),
    ("logit_bias key not an id", "/v1/completions", comp(logit_bias={"the": 5}), {}, 400, "'logit_bias.the': string should match", "logit_bias"),
    ("logit_bias id outside the vocabulary", "/v1/completions", comp(logit_bias={"999999": 5}), {}, 400,
     "[0, ", "logit_bias"),
    ("logit_bias over 100", "/v1/completions", comp(logit_bias={"5": 101}), {}, 400, "logit_bias", "logit_bias"),
    ("stop_token_ids outside the vocabulary", "/v1/completions", comp(stop_token_ids=[10**6]), {}, 400, "[0, ",
     "stop_token_ids"),
    ("best_of below n", "/v1/completions", comp(n=3, best_of=2), {}, 400, "best_of", "best_of"),
    ("best_of streamed", "/v1/completions", comp(best_of=2, stream=True), {}, 400, "streamed", "best_of"),
    ("max_tokens 0 without echo", "/v1/completions", comp(max_tokens=0), {}, 400, "only with echo", "max_tokens"),
    ("suffix", "/v1/completions", comp(suffix="!"), {}, 400, "suffix is not supported", "suffix"),
    ("functions", "/v1/chat/completions", chat(functions=[{"name": "f"}]), {}, 400, "send tools", "functions"),
    ("function_call", "/v1/chat/completions", chat(function_call="auto"), {}, 400, "tool_choice", "function_call"),
    ("unknown field", "/v1/completions", comp(max_token=5), {}, 400,
     "unknown field 'max_token'; did you mean 'max_tokens'?", "max_token"),
    ("unknown field in chat", "/v1/chat/completions", chat(temprature=0), {}, 400, "did you mean 'temperature'",
     "temprature"),
    ("unknown field in a message", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "x": 1}]),
     {}, 400, "unknown field 'messages[0].x'", "messages"),
    ("tool without function", "/v1/chat/completions", chat(tools=[{"type": "function"}]), {}, 400,
     "'tools[0].function' is required", "tools"),
    ("tool_choice without tools", "/v1/chat/completions", chat(tool_choice="required"), {}, 400, "needs tools",
     "tool_choice"),
    ("tool_choice naming no tool", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}),
     {}, 400, "not among the tools", "tool_choice"),
    ("tool message without its call id", "/v1/chat/completions", chat(messages=[{"role": "tool", "content": "x"}]), {},
     400, "tool_call_id", "messages"),
    ("json_schema without its schema", "/v1/chat/completions", chat(response_format={"type": "json_schema"}), {}, 400,
     "needs 'json_schema'", "response_format"),
    ("an invalid JSON schema", "/v1/completions", comp(guided_json={"type": "nope"}), {}, 400, "guided_json",
     "guided_json"),
    ("an invalid regex", "/v1/completions", comp(structured_outputs={"regex": "(("}), {}, 400, "structured_outputs",
     "structured_outputs"),
    ("two structured outputs", "/v1/chat/completions", chat(guided_regex="a", response_format={"type": "json_object"}),
     {}, 400, "cannot be combined", "guided_regex"),
    ("surrogate in a prompt", "/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', {}, 400,
     "surrogate", "prompt"),
    ("surrogate in a message", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', {}, 400, "'messages[0].content'",
     "messages"),
    ("surrogate in the model name", "/v1/completions", b'{"model": "t\\ud83d", "prompt": "x"}', {}, 400,
     "surrogate", "model"),
    ("surrogate in a stop string", "/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": "\\ud800"}', {},
     400, "'stop' holds a lone UTF-16 surrogate", "stop"),
    ("surrogate in a field's name", "/v1/completions", b'{"model": "tiny", "prompt": "x", "\\ud800": 1}',
     {}, 400, "a field name holds a lone UTF-16 surrogate", None),
    ("unknown model", "/v1/completions", comp(model="gpt-4"), {}, 404, "'gpt-4' does not exist", "model"),
    ("unknown model by id", "/v1/models/gpt-4", None, {}, 404, "'gpt-4' does not exist", "model"),
    ("unknown model in chat", "/v1/chat/completions", chat(model="gpt-4"), {}, 404, "'gpt-4' does not exist", "model"),
    ("no API key", "/v1/completions", comp(), {"Authorization": ""}, 401, "API key", None),
    ("wrong API key", "/v1/chat/completions", chat(), {"Authorization": "Bearer nope"}, 401, "API key", None),
    ("key in the wrong scheme", "/v1/models", None, {"Authorization": f"Basic {KEY}"}, 401, "API key", None),
    ("body over the limit", "/v1/completions", comp(prompt="x" * BODY_LIMIT), {}, 413, "limit", None),
    ("unknown route", "/v1/embeddings", comp(), {}, 404, "no such route", None),
]


@pytest.mark.parametrize("name,path,body,headers,status,words,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status_and_a_message_naming_the_problem(server, name, path, body, headers, status,
                                                                    words, param):
    h = {**AUTH, **headers}
    if body is None: r = httpx.get(server.url + path, headers=h)
    elif isinstance(body, bytes): r = httpx.post(server.url + path, content=body,
                                                 headers={"Content-Type": "application/json", **h})
    else: r = httpx.post(server.url + path, json=body, headers=h)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert words in error["message"], error
    assert error["param"] == param, error


def test_chunked_body_over_the_limit_gets_413(server):
    def chunks():                                       # no Content-Length: the limit is found by counting
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1): yield b"x" * 1024
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_wrong_method_gets_405_with_allow(server):
    r = httpx.get(server.url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "not allowed" in r.json()["error"]["message"]


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
        client.completions.create(model="tiny", prompt="x", suffix="!")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


# --- schemathesis --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, env):
    s = start(tmp_path_factory, env, "fuzz", ["--max-model-len", "128"])
    yield s
    assert s.stop() == 0, s.log.read_text()


def test_schemathesis_finds_no_5xx_and_only_documented_statuses(fuzz_server, tmp_path):
    # positive_data_acceptance and the validation_mismatch warning are left out: the schema cannot say "prompt +
    # max_tokens within the context", "token ids within the vocabulary", "top_logprobs needs logprobs", "one
    # structured output" or "a valid regex", so a schema-valid request may rightly get 400. Every other warning
    # (missing test data: an id the schema does not name, ...) stays on.
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", fuzz_server.url + "/openapi.json",
           "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--phases", "coverage,fuzzing",
           "--max-examples", "20", "--seed", "1", "--generation-database", "none", "--request-timeout", "60",
           "--no-color", "--workers", "1",
           "--warnings", "missing_auth,missing_test_data,base_url_mismatch,missing_deserializer,unsupported_regex"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "No issues found" in res.stdout, res.stdout[-6000:]
    m = metrics(fuzz_server.url)
    assert sum(v for k, v in m.items() if k.startswith("nanoserve_requests_finished_total")) > 10  # it got through


# --- overload and shutdown -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_server(tmp_path_factory, env):
    nanoserve = str(Path(sys.executable).parent / "nanoserve")
    s = start(tmp_path_factory, env, "small", ["--api-key", KEY, "--max-num-seqs", "1", "--max-waiting", "1",
                                              "--shutdown-grace", "0"], cmd=[nanoserve, "serve"])
    yield s
    s.stop()


def test_full_queue_gets_503_then_shutdown_aborts_requests_in_flight(small_server):
    url = small_server.url
    long = {"model": "tiny-qwen2-v1", "prompt": "x", "max_tokens": CONTEXT - 8, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as running:
                lines = running.aiter_lines()
                first = await anext(line async for line in lines if line)            # it runs
                waiting = asyncio.ensure_future(c.post("/v1/completions", json=long))   # it waits (1 sequence)
                while metrics(url)["nanoserve_requests_waiting"] < 1: await asyncio.sleep(0.02)
                full = await c.post("/v1/completions", json=long)                     # nowhere to wait
                small_server.proc.send_signal(signal.SIGINT)                          # shutdown, grace 0
                rest = [first] + [line async for line in lines]
                return full, sse_events(rest), await waiting

    full, streamed, waited = asyncio.run(run())
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert "overloaded" in full.json()["error"]["message"] and full.json()["error"]["type"] == "server_error"
    # aborted at shutdown: no finish_reason "abort" (no OpenAI client knows it), an error event / a 503
    assert streamed[-1] == "[DONE]" and streamed[-2]["error"]["code"] == "unavailable"
    assert all(e["choices"][0]["finish_reason"] is None for e in streamed[:-2])
    assert waited.status_code == 503 and "aborted" in waited.json()["error"]["message"]
    assert small_server.proc.wait(30) == 0                                           # the process ends cleanly
    log = small_server.log.read_text()
    assert "Traceback" not in log, log
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")


# --- rough edges -----------------------------------------------------------------------------------------------

def http_exchange(sock, body: bytes, path: str = "/v1/completions") -> tuple[int, bytes]:
    "One keep-alive HTTP/1.1 request on a raw socket: (status, body)."
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (path.encode(), KEY.encode(), len(body)) + body)
    data = b""
    while b"\r\n\r\n" not in data: data += sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(rest) < length: rest += sock.recv(65536)
    return int(head.split()[1]), rest


def test_a_surrogate_is_a_400_and_the_connection_stays_usable(server):
    import socket
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for _ in range(3):
            status, body = http_exchange(sock, b'{"model": "tiny", "prompt": "a\\ud800", "max_tokens": 1}')
            assert status == 400 and b"surrogate" in body, body
            status, body = http_exchange(sock, b'{"model": "tiny", "prompt": "ok", "max_tokens": 1}')
            assert status == 200, body                          # the same connection, the next request
    # the module's fixture checks that the log holds no traceback


@pytest.fixture(scope="module")
def edge_server(tmp_path_factory, env):
    s = start(tmp_path_factory, env, "edge", ["--served-model-name", "tiny", "--max-num-seqs", "4", "--max-waiting", "5",
                                             "--body-timeout", "1", "--engine-in-thread"])
    yield s
    assert s.stop() == 0, s.log.read_text()
    assert "Traceback" not in s.log.read_text(), s.log.read_text()


def test_half_a_body_gets_408_and_its_connection_closed(edge_server):
    import socket
    host, port = edge_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny", ')
        t0 = time.monotonic()
        data = b""
        while chunk := sock.recv(65536): data += chunk          # until the server closes the connection
        elapsed = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in data, data
    assert 0.8 < elapsed < 10, elapsed
    assert httpx.get(edge_server.url + "/health").status_code == 200


def test_waiting_is_counted_against_the_engine_s_capacity(edge_server):
    "--max-num-seqs 4 --max-waiting 5: of 30 simultaneous requests, 9 are taken and 21 get 503 at once."
    body = {"model": "tiny", "prompt": "x", "max_tokens": CONTEXT - 8, "ignore_eos": True, "stream": True}
    statuses, all_in = [], asyncio.Event()

    async def one(c):
        async with c.stream("POST", "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            if len(statuses) == 30: all_in.set()
            await all_in.wait()                                 # hold the taken ones until every answer is in

    async def run():
        limits = httpx.Limits(max_connections=30)
        async with httpx.AsyncClient(base_url=edge_server.url, limits=limits, timeout=60) as c:
            await asyncio.gather(*(one(c) for _ in range(30)))
    asyncio.run(run())
    assert sorted(statuses) == [200] * 9 + [503] * 21, statuses


def test_serve_on_a_busy_port_fails_before_loading_the_model(env, tmp_path):
    import socket
    nanoserve = str(Path(sys.executable).parent / "nanoserve")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0)); busy.listen()
        t0 = time.monotonic()
        res = subprocess.run([nanoserve, "serve", "--port", str(busy.getsockname()[1]), "--model", "/no/such/model"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "cannot listen on 127.0.0.1:" in res.stderr, res.stderr
    assert "/no/such/model" not in res.stderr, res.stderr          # refused before the model was looked at
    print(f"refused in {time.monotonic() - t0:.1f} s: {res.stderr.strip()}")


def test_a_model_that_cannot_load_fails_before_serving_with_the_engine_process_error(env):
    "The engine's process says why it could not load; the server exits 2 with that message, nothing left running."
    nanoserve = str(Path(sys.executable).parent / "nanoserve")
    res = subprocess.run([nanoserve, "serve", "--port", "0", "--model", "/no/such/model", "--device", "cpu"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 2 and "nanoserve serve: error:" in res.stderr and "/no/such/model" in res.stderr, res.stderr
    assert "serving" not in res.stdout, res.stdout


# --- packaging -----------------------------------------------------------------------------------------------

def test_the_package_imports_without_fastapi_and_serve_says_what_to_install():
    code = ("import sys\n"
            "for m in ('fastapi', 'uvicorn', 'starlette', 'pydantic'): sys.modules[m] = None\n"
            "import nanoserve, nanoserve.cli, nanoserve.block_manager, nanoserve.scheduler\n"
            "from nanoserve.cli import main\n"
            "sys.exit(main(['serve']))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    assert "pip install 'nanoserve[server]'" in res.stderr


def imports(nodes) -> set[str]:
    names = {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module}


def test_only_the_server_module_imports_the_web_stack():
    "Anywhere else, not even inside a function; and nothing imports the server when it is imported (cli does, lazily)."
    web = {"fastapi", "uvicorn", "starlette", "pydantic"}
    for path in (ROOT / "nanoserve").glob("*.py"):
        if path.name == "server.py": continue
        tree = ast.parse(path.read_text())
        assert not {m.split(".")[0] for m in imports(ast.walk(tree))} & web, path.name
        assert not {"nanoserve.server", "server"} & imports(tree.body), path.name


def test_stream_chunks_carry_tokens_without_text():
    "A step whose tokens decode to no text yet still makes a chunk (clients time tokens by chunks); finish chunks carry none."
    from nanoserve.server import ResponseShaper
    from nanoserve.endpoint import chunk_info
    for kind in ("completion", "chat"):
        shaper = ResponseShaper(kind, "tiny", include_usage=False)
        assert chunk_info(shaper.chunk(""))["token"] is True
        assert chunk_info(shaper.chunk("ab"))["text"] == "ab"
        assert chunk_info(shaper.chunk(finish_reason="stop"))["token"] is False
    assert chunk_info(ResponseShaper("chat", "tiny", include_usage=False).chunk(first=True))["token"] is False


def test_serve_passes_the_scheduling_options_to_the_engine(monkeypatch):
    "`--scheduling`, `--no-mixed-step-graphs`, `--no-row-gemv`, `--no-pdl` reach the engine's process (captured; it refuses to load)."
    import nanoserve.server as server
    seen = []
    def fake_engine(llm_kwargs, **kw):
        seen.append(llm_kwargs)
        raise ValueError("not loading a model in this test")
    monkeypatch.setattr(server, "EngineProcess", fake_engine)
    assert server.main(["--scheduling", "sync", "--no-mixed-step-graphs", "--no-row-gemv", "--no-pdl", "--device", "cpu",
                        "--threads", "3", "--port", "0"]) == 2
    assert server.main(["--device", "cpu", "--port", "0"]) == 2
    assert (seen[0]["async_scheduling"], seen[0]["mixed_step_graphs"]) == (False, False)
    assert (seen[1]["async_scheduling"], seen[1]["mixed_step_graphs"]) == (None, True)
    assert (seen[0]["row_gemv"], seen[1]["row_gemv"]) == (False, None)
    assert (seen[0]["pdl"], seen[1]["pdl"]) == (False, None)
    assert (seen[0]["num_threads"], seen[1]["num_threads"]) == (3, None)
    with pytest.raises(SystemExit):
        server.main(["--scheduling", "sometimes"])


def test_serve_warns_when_listening_beyond_loopback_without_a_key(monkeypatch, capsys):
    import nanoserve.server as server
    def fake_engine(*args, **kw): raise ValueError("not loading a model in this test")
    monkeypatch.setattr(server, "EngineProcess", fake_engine)
    monkeypatch.delenv("NANOSERVE_API_KEY", raising=False)
    assert server.main(["--host", "0.0.0.0", "--port", "0", "--device", "cpu"]) == 2
    assert "warning: listening on 0.0.0.0 with no --api-key" in capsys.readouterr().err
    assert server.main(["--host", "0.0.0.0", "--port", "0", "--api-key", "k", "--device", "cpu"]) == 2
    assert server.main(["--port", "0", "--device", "cpu"]) == 2
    assert "warning" not in capsys.readouterr().err

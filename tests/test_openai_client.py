"""Every feature of the server's API through the official `openai` client: one in-process server (ServerThread) for
the module, the random tiny model on the CPU (2 layers of 64: milliseconds a token), few tokens per call.

What each call asks for and what it checks is in its test's name and asserts: logprobs and echo (completions),
n, best_of, batched prompts, penalties, logit_bias, seeds, chat logprobs, response_format json_schema,
structured_outputs / guided_* through extra_body, tools (required, named, auto, and a tool-role follow-up),
streaming of each, models.retrieve, and bad input raised as openai.BadRequestError naming the parameter.
"""
from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from nanoserve.engine import LLM
from nanoserve.server import ServerThread, build_app
from nanoserve.tokenizer import TINY_MODEL_NAME, build_tiny_model, load_tokenizer

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                                  "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["answer", "confidence"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("cache") / TINY_MODEL_NAME)


@pytest.fixture(scope="module")
def client(model_dir):
    llm = LLM(str(model_dir), device="cpu", max_num_seqs=16, num_kv_blocks=256, num_threads=1)
    with ServerThread(build_app(llm, served_model_name=MODEL)) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as c:
            yield c
    llm.close()


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


def greedy(**kw):
    return {"model": MODEL, "temperature": 0, **kw}


# --- completions ---------------------------------------------------------------------------------------------

def test_completions_logprobs(client):
    r = client.completions.create(**greedy(prompt="def f(x):", max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob)
        assert max(top, key=top.get) == token                    # greedy: the chosen token is the most likely


def test_echo_scores_the_prompt_with_max_tokens_0(client, tok):
    prompt = "import os\nimport sys"
    r = client.completions.create(**greedy(prompt=prompt, max_tokens=0, echo=True, logprobs=1))
    c, lp = r.choices[0], r.choices[0].logprobs
    assert c.text == prompt and r.usage.completion_tokens == 0 and c.finish_reason == "length"
    assert len(lp.tokens) == len(tok.encode(prompt)) and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # echo with generation: the prompt's logprobs, then the answer's, the same prompt values as scoring alone
    g = client.completions.create(**greedy(prompt=prompt, max_tokens=2, echo=True, logprobs=1,
                                           extra_body={"ignore_eos": True}))
    assert g.choices[0].text.startswith(prompt) and len(g.choices[0].logprobs.tokens) == len(lp.tokens) + 2
    assert g.choices[0].logprobs.token_logprobs[1:len(lp.tokens)] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_n_batched_prompts_and_best_of(client):
    r = client.completions.create(model=MODEL, prompt=["def", "class"], n=2, max_tokens=3, seed=7,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 12
    best = client.completions.create(model=MODEL, prompt="def", n=1, best_of=3, max_tokens=3, seed=7, logprobs=0,
                                     extra_body={"ignore_eos": True})
    assert len(best.choices) == 1 and len(best.choices[0].logprobs.tokens) == 3


def test_seed_penalties_and_logit_bias(client, tok):
    kw = dict(model=MODEL, prompt="for i in", max_tokens=6, temperature=1.0, seed=1234, presence_penalty=1.5,
              frequency_penalty=0.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "min_p": 0.01})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    forced = tok.encode(" the")[0]
    r = client.completions.create(**greedy(prompt="x", max_tokens=3, logit_bias={str(forced): 100},
                                           extra_body={"ignore_eos": True}))
    assert r.choices[0].text == " the" * 3


def test_completions_stream_with_logprobs_and_n(client):
    chunks = list(client.completions.create(**greedy(prompt="def", max_tokens=3, n=2, logprobs=1, stream=True,
                                                     extra_body={"ignore_eos": True})))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert sum(len(c.logprobs.tokens) for c in mine if c.logprobs) == 3
        assert [c.finish_reason for c in mine][-1] == "length"


# --- chat ----------------------------------------------------------------------------------------------------

def test_chat_logprobs_top_logprobs_and_n(client):
    r = client.chat.completions.create(**greedy(messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=2,
                                                logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}))
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.content == r.choices[1].message.content
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert content[0].top_logprobs[0].token == content[0].token and bytes(content[0].bytes).decode() == content[0].token
    chunks = list(client.chat.completions.create(**greedy(messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                                          logprobs=True, stream=True, extra_body={"ignore_eos": True})))
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == 3


def test_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Yes?"}], max_tokens=40,
                                       response_format=fmt, seed=3)
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER_SCHEMA)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Yes?"}],
                                                 max_tokens=40, response_format={"type": "json_object"}, stream=True))
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), dict)


def test_structured_outputs_regex_and_choice(client):
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=8, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text)
    for extra in ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, {"guided_choice": ["red", "green"]}):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A colour?"}],
                                           max_tokens=5, extra_body=extra)
        assert r.choices[0].message.content in ("red", "green", "blue")


# --- tools ---------------------------------------------------------------------------------------------------

def test_tools_required_named_and_a_tool_role_follow_up(client):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CLOCK], tool_choice="required",
                                       max_tokens=200, seed=5, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "now")
    named = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CLOCK], max_tokens=200, seed=5,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    follow = ask + [named.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], max_tokens=4)   # auto
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tools_streamed(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], max_tokens=200, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# --- models and errors -------------------------------------------------------------------------------------

def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


BAD = [  # (call, keywords, the param named)
    ("completions", dict(prompt="x", extra_body={"max_token": 5}), "max_token"),
    ("completions", dict(prompt="x", suffix="!"), "suffix"),
    ("completions", dict(prompt="x", logprobs=6), "logprobs"),
    ("completions", dict(prompt="x", n=2, best_of=1), "best_of"),
    ("completions", dict(prompt="x", logit_bias={"999999": 1}), "logit_bias"),
    ("completions", dict(prompt="x", extra_body={"guided_json": {"type": "nope"}}), "guided_json"),
    ("chat", dict(top_logprobs=2), "top_logprobs"),
    ("chat", dict(tool_choice="required"), "tool_choice"),
    ("chat", dict(functions=[{"name": "f"}]), "functions"),
    ("chat", dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex"),
]


@pytest.mark.parametrize("kind,kw,param", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_a_bad_request_naming_the_param(client, kind, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "completions": client.completions.create(model=MODEL, **kw)
        else: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], **kw)
    assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body

"""Structured output (nanoserve.structured): specs, the grammar compiler and its cache, bitmasks, decoding under
a grammar from random logits, forced tool calls and the tool-call parser (whole and streamed)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from nanoserve.structured import (GrammarCompiler, StructuredOutputs, ToolCallStream, apply_bitmask_ref,
                                  check_tools, parse_tool_calls, tool_call_outputs)
from nanoserve.tokenizer import default_model, load_tokenizer

pytest.importorskip("llguidance")
try:
    import jsonschema
except ImportError:
    jsonschema = None

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer) + 70)    # a model vocabulary larger than the tokenizer


def allowed(bitmask: torch.Tensor, row: int) -> list[int]:
    return [t for t in range(32 * bitmask.shape[1]) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1]


def decode(compiled, tokenizer, seed: int, max_tokens: int = 300) -> tuple[str, bool]:
    "Greedy decoding from random logits masked by the matcher's bitmask: (text, ended at EOS or termination)."
    g, m = torch.Generator().manual_seed(seed), compiled.matcher()
    mask, ids = torch.zeros(1, m.bitmask_width, dtype=torch.int32), []
    for _ in range(max_tokens):
        if m.is_terminated(): return tokenizer.decode(ids), True
        m.fill_bitmask(mask, 0)
        token_id = int(apply_bitmask_ref(torch.randn(1, compiled.vocab_size, generator=g), mask).argmax())
        if token_id == tokenizer.eos_token_id: return tokenizer.decode(ids), True
        assert m.accept(token_id), token_id
        ids.append(token_id)
    return tokenizer.decode(ids), False


def validate(value, schema) -> None:
    if jsonschema is not None: jsonschema.validate(value, schema)
    else: assert isinstance(value, dict) and set(schema.get("required", [])) <= set(value)


# -- the spec --------------------------------------------------------------------------------------------------------

def test_spec_is_a_validated_value():
    s = StructuredOutputs(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    assert s.json == '{"type":"object","properties":{"b":{"type":"integer"},"a":{}}}'   # compact, order kept
    assert s == StructuredOutputs(json=' {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}} ')
    assert hash(s) == hash(StructuredOutputs(json=s.json)) and s.kind == "json"
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")
    with pytest.raises(Exception): s.json = "{}"     # frozen


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"), (dict(regex="a", grammar="start: \"a\""), "exactly one of"),
    (dict(json_object=True, json={}), "exactly one of"), (dict(json="{nope"), "not valid JSON"),
    (dict(json="[1]"), "must be a JSON object"), (dict(json=3), "must be a JSON object"),
    (dict(choice=[]), "non-empty list"), (dict(choice="ab"), "non-empty list"), (dict(choice=["a", None]), "only strings"),
    (dict(regex=""), "regex must be a non-empty string"), (dict(regex=3), "regex must be"),
    (dict(grammar=""), "grammar must be"), (dict(json_object="yes"), "json_object must be a bool"),
    (dict(json_object=True, any_whitespace=1), "any_whitespace must be a bool")])
def test_spec_rejects_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputs(**kwargs)


# -- the compiler ----------------------------------------------------------------------------------------------------

def test_compiler_arguments(tokenizer):
    with pytest.raises(ValueError, match="vocab_size must be"): GrammarCompiler(tokenizer, len(tokenizer) - 1)
    with pytest.raises(ValueError, match="cache_size must be"): GrammarCompiler(tokenizer, len(tokenizer), cache_size=0)
    c = GrammarCompiler(tokenizer, 3072 + 1)
    assert c.bitmask_width == 97
    with pytest.raises(ValueError, match="expected StructuredOutputs"): c.compile({"type": "object"})


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json={"type": "strin"}), "invalid JSON schema: Invalid type: strin"),
    (StructuredOutputs(json={"type": "string", "pattern": "(?<=a)b"}), "look-around"),
    (StructuredOutputs(json={"type": "string", "minLength": "x"}), "minLength"),
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "invalid JSON schema"),
    (StructuredOutputs(regex="[a-z"), "invalid regex"), (StructuredOutputs(regex="(a"), "unclosed group"),
    (StructuredOutputs(regex=r"(a)\1"), "backreferences are not supported"),
    (StructuredOutputs(grammar='start: "a" b'), 'unknown name: "b"'),
    (StructuredOutputs(grammar="root ::= (x"), "invalid grammar (read as GBNF: it has no Lark `start:` rule): Expected ')'"),
    (StructuredOutputs(grammar='root ::= "a" missing'), "Rule 'missing' not found")])
def test_invalid_specs_name_the_problem(compiler, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.compile(spec)


def test_cache_hit_is_the_same_object_and_builds_nothing(tokenizer, monkeypatch):
    c = GrammarCompiler(tokenizer, len(tokenizer), cache_size=2)
    built, build = [], c._build
    monkeypatch.setattr(c, "_build", lambda spec: built.append(spec) or build(spec))   # counts llguidance's work
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    first = c.compile(StructuredOutputs(json=schema))
    again = c.compile(StructuredOutputs(json=json.dumps(schema)))   # the same schema as text: the same cache key
    assert again is first and (c.num_hits, c.num_misses) == (1, 1) and len(built) == 1
    c.compile(StructuredOutputs(regex="a")); c.compile(StructuredOutputs(regex="b"))   # evicts the schema (LRU)
    assert len(c) == 2 and c.compile(StructuredOutputs(json=schema)) is not first
    c.compile(StructuredOutputs(regex="b"))
    assert c.compile(StructuredOutputs(regex="b")) is c.compile(StructuredOutputs(regex="b"))


def test_concurrent_compiles_share_one_object(tokenizer):
    c = GrammarCompiler(tokenizer, len(tokenizer))
    spec = StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "string", "maxLength": 4}}})
    got, barrier = [], threading.Barrier(6)

    def work():
        barrier.wait()
        got.append(c.compile(spec))
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert len(got) == 6 and all(g is got[0] for g in got) and len(c) == 1


def test_bitmask_rows_past_the_tokenizer_are_zero(compiler, tokenizer):
    n = len(tokenizer)
    for spec in (StructuredOutputs(json_object=True), StructuredOutputs(regex="[^x]*"), StructuredOutputs(choice=["hi"])):
        m = compiler.compile(spec).matcher()
        mask = torch.full((3, compiler.bitmask_width), -1, dtype=torch.int32)
        m.fill_bitmask(mask, 1)
        assert allowed(mask, 0) == list(range(32 * compiler.bitmask_width))     # other rows untouched
        got = allowed(mask, 1)
        assert got and max(got) < n, max(got)
        assert not m.accept(n) and not m.accept(n + 50) and not m.accept(-1)
    m = compiler.compile(StructuredOutputs(regex="[^x]*")).matcher()      # almost every token is allowed
    mask = torch.zeros(1, compiler.bitmask_width, dtype=torch.int32)
    m.fill_bitmask(mask, 0)
    assert len(allowed(mask, 0)) > n // 2 and max(allowed(mask, 0)) < n
    with pytest.raises(ValueError, match="int32 CPU tensor"): m.fill_bitmask(torch.zeros(1, 3, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="int32 CPU tensor"): m.fill_bitmask(torch.zeros(1, compiler.bitmask_width), 0)


def test_refused_token_leaves_the_matcher_as_it_was(compiler, tokenizer):
    m = compiler.compile(StructuredOutputs(regex="ab+")).matcher()
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    assert m.accept(a) and not m.accept(a) and m.accept(b)
    assert m.is_accepting() and not m.is_terminated()
    mask = torch.zeros(1, compiler.bitmask_width, dtype=torch.int32)
    m.fill_bitmask(mask, 0)
    assert tokenizer.eos_token_id in allowed(mask, 0)       # complete: EOS may follow
    m.rollback(1)
    assert not m.is_accepting()
    t = compiler.compile(StructuredOutputs(choice=["ab"])).matcher()
    assert t.accept(a) and t.accept(b) and t.is_terminated()


def test_matchers_are_independent(compiler, tokenizer):
    cg = compiler.compile(StructuredOutputs(choice=["ab", "ba"]))
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    m1, m2 = cg.matcher(), cg.matcher()
    assert m1.accept(a) and m2.accept(b) and not m1.accept(a) and m1.accept(b) and m2.accept(a)
    assert m1.is_terminated() and m2.is_terminated() and cg.matcher().accept(a)


# -- decoding under a grammar ----------------------------------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
                                      "ok": {"type": "boolean"}, "kind": {"const": "point"}},
     "required": ["tags", "ok", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                                            "y": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}},
                                            "required": ["x", "y"], "additionalProperties": False},
                                      "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
     "required": ["p", "code"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
@pytest.mark.parametrize("any_whitespace", [False, True])
def test_json_schema_output_validates(compiler, tokenizer, schema_index, any_whitespace):
    schema = SCHEMAS[schema_index]
    cg = compiler.compile(StructuredOutputs(json=schema, any_whitespace=any_whitespace))
    for seed in range(4):
        text, done = decode(cg, tokenizer, seed, max_tokens=600)
        if any_whitespace and not done: continue      # a random model may spend its budget on whitespace
        assert done, text
        validate(json.loads(text), schema)
        if not any_whitespace: assert text == json.dumps(json.loads(text), ensure_ascii=False), text   # json.dumps' layout exactly


def test_json_object_output_is_an_object(compiler, tokenizer):
    cg = compiler.compile(StructuredOutputs(json_object=True))
    finished = 0
    for seed in range(6):
        text, done = decode(cg, tokenizer, seed, max_tokens=400)
        if done:
            finished += 1
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.startswith("{"), text
    assert finished >= 1


@pytest.mark.parametrize("spec, check", [
    (StructuredOutputs(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", t)),
    (StructuredOutputs(regex=r"(cat|dog)s? [a-z]{1,5}"), lambda t: re.fullmatch(r"(cat|dog)s? [a-z]{1,5}", t)),
    (StructuredOutputs(choice=["red", "green", "dark blue", "é ü"]), lambda t: t in ("red", "green", "dark blue", "é ü")),
    (StructuredOutputs(grammar='root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?'),
     lambda t: re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", t)),
    (StructuredOutputs(grammar='start: "[" ITEM ("," ITEM)* "]"\nITEM: /[a-c]/'), lambda t: re.fullmatch(r"\[[a-c](,[a-c])*\]", t)),
    (StructuredOutputs(grammar='start: "x=" %json {"type": "integer", "minimum": 0, "maximum": 99}'),
     lambda t: t.startswith("x=") and 0 <= json.loads(t[2:]) <= 99)], ids=["date", "words", "choice", "gbnf", "lark", "lark-json"])
def test_regex_choice_grammar_outputs(compiler, tokenizer, spec, check):
    cg = compiler.compile(spec)
    for seed in range(4):
        text, done = decode(cg, tokenizer, seed)
        assert done and check(text), text


def test_apply_bitmask_ref():
    bm = torch.tensor([[0b101, -2 ** 31], [-1, 0]], dtype=torch.int32)
    out = apply_bitmask_ref(torch.zeros(2, 70), bm)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2, 63]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == list(range(32))
    assert torch.isfinite(apply_bitmask_ref(torch.zeros(1, 40), torch.tensor([[-1, 1]], dtype=torch.int32))).sum() == 33


# -- tool calls ------------------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, CLOCK]


def test_tool_choice_none_and_auto_need_no_grammar():
    for choice in ("none", "auto", None):
        assert tool_call_outputs(TOOLS, choice) is None
    assert tool_call_outputs(None, None) is None


@pytest.mark.parametrize("tools, choice, message", [
    ([], "required", "at least one tool"), (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not among"),
    (TOOLS, "always", "tool_choice must be"), (TOOLS, {"type": "function"}, "tool_choice must be"),
    ("get_weather", "auto", "tools must be a list"), ([{"type": "function"}], "auto", "tools[0] must be"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "required", "tools[0] must be"),
    ([CLOCK, {"type": "function", "function": {"name": "has space"}}], "auto", "tools[1].function.name"),
    ([CLOCK, CLOCK], "required", "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "required", "parameters must be a JSON schema")])
def test_bad_tools_and_choices(tools, choice, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tool_call_outputs(tools, choice)


def test_bad_parameters_schema_is_a_compile_error(compiler):
    spec = tool_call_outputs([{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}], "required")
    with pytest.raises(ValueError, match="invalid grammar"):
        compiler.compile(spec)


def test_named_tool_call_is_forced(compiler, tokenizer):
    spec = tool_call_outputs(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    for seed in range(3):
        text, done = decode(compiler.compile(spec), tokenizer, seed)
        assert done and text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": ') and text.endswith("}\n</tool_call>")
        content, calls = parse_tool_calls(text)
        assert content == "" and [c["name"] for c in calls] == ["get_weather"]
        validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_required_tool_calls(compiler, tokenizer):
    params = check_tools(TOOLS)
    names = set()
    for seed in range(6):
        text, done = decode(compiler.compile(tool_call_outputs(TOOLS, "required")), tokenizer, seed)
        content, calls = parse_tool_calls(text)
        assert done and content == "" and calls, text
        for c in calls:
            names.add(c["name"])
            validate(json.loads(c["arguments"]), params[c["name"]])
        one, done = decode(compiler.compile(tool_call_outputs(TOOLS, "required", parallel_tool_calls=False)), tokenizer, seed)
        assert done and len(parse_tool_calls(one)[1]) == 1, one
    assert names == {"get_weather", "get_time"}


# -- parsing tool calls ----------------------------------------------------------------------------------------------

def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


F, G = {"name": "f", "arguments": '{"x": 1}'}, {"name": "g", "arguments": "{}"}


@pytest.mark.parametrize("text, expected", [
    ("plain text", ("plain text", [])),
    ("", ("", [])),
    (call("f", '{"x": 1}'), ("", [F])),
    (call("f", '{"x": 1}') + "\n" + call("g", "{}"), ("", [F, G])),                          # two calls
    ("I will check.\n\n" + call("f", '{"x": 1}'), ("I will check.", [F])),                  # text before
    ("Done " + call("f", '{"x": 1}') + "\nand more", ("Doneand more", [F])),                 # text around
    ("a <tool_call>\n{\"name\": \"f\", \"argu", ("a <tool_call>\n{\"name\": \"f\", \"argu", [])),   # unterminated
    ("a " + call("f", '{"x": ') + " b", ("a " + call("f", '{"x": ') + " b", [])),          # bad JSON: content
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),   # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [])),
    ('<tool_call>{"name": "g"}</tool_call>', ("", [G])),                                  # arguments left out: {}
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', ("", [F])),      # arguments as JSON text
    ("x < y, <tool>, </tool_call> ", ("x < y, <tool>, </tool_call> ", [])),
    ("end <tool_ca", ("end <tool_ca", [])),                                               # a partial tag at the end
])
def test_parse_tool_calls(text, expected):
    assert parse_tool_calls(text) == expected


def test_parse_keeps_unicode_arguments():
    content, calls = parse_tool_calls(call("f", '{"city": "Zürich", "n": [1, 2.5, null]}'))
    assert json.loads(calls[0]["arguments"]) == {"city": "Zürich", "n": [1, 2.5, None]} and "Zürich" in calls[0]["arguments"]


def stream(text: str, sizes) -> tuple[list[str], list[dict], list[int]]:
    "Feed `text` in deltas of the given sizes (cycled): the content deltas, the calls, and at which delta each call came."
    s, pieces, calls, when, i, k = ToolCallStream(), [], [], [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]; k += 1
        c, new = s.feed(text[i:i + n]); pieces.append(c); calls += new; when += [i + n] * len(new); i += n
    c, new = s.flush()
    return pieces + [c], calls + new, when + [len(text)] * len(new)


STREAM_TEXTS = [
    "Sure <b>!\n" + call("f", '{"x": 1}') + "\n" + call("g", "{}") + "\n <tool_call>{bad}</tool_call> end <tool",
    "a<" + call("f", '{"x": 1}') + "<<tool_call>" + call("g", "{}"),
    "  lead " + call("g", "{}") + "   ",
    "no calls at all, just < and <tool and text",
    "trailing " + call("f", '{"x": 1}')[:-3],
]


@pytest.mark.parametrize("text_index", range(len(STREAM_TEXTS)))
@pytest.mark.parametrize("sizes", [[1], [2, 3], [5, 1, 7], [11], [10 ** 6]], ids=str)
def test_stream_agrees_with_whole_text(text_index, sizes):
    text = STREAM_TEXTS[text_index]
    pieces, calls, _ = stream(text, sizes)
    assert ("".join(pieces), calls) == parse_tool_calls(text)


def test_stream_holds_back_and_emits_at_the_closing_tag():
    text = "Hi " + call("f", '{"x": 1}') + " bye"
    pieces, calls, when = stream(text, [1])
    assert calls == [F] and when == [text.index("</tool_call>") + len("</tool_call>")]   # at the delta that closed it
    assert not any("<" in p for p in pieces)                                              # no tag text leaked as content
    s = ToolCallStream()
    assert s.feed("Hi <tool_") == ("Hi", [])              # "<tool_" and the space before it wait
    assert s.feed("call>\n{\"name\": \"g\", \"argu") == ("", [])
    assert s.feed('ments": {}}\n</tool_call>') == ("", [G])
    assert s.feed(" x") == ("x", []) and s.flush() == ("", [])
    s = ToolCallStream()
    assert s.feed("a <") == ("a", []) and s.feed("b") == (" <b", [])     # not a tag after all: released at once


def test_grammar_text_names_the_kinds(compiler):
    assert {StructuredOutputs(**kw).kind for kw in (dict(json={}), dict(json_object=True), dict(regex="a"), dict(choice=["a"]),
                                                    dict(grammar='start: "a"'))} == {"json", "json_object", "regex", "choice", "grammar"}


def test_imports_and_fails_clearly_without_llguidance():
    code = ("import sys; sys.modules['llguidance'] = None\n"
            "import nanoserve.structured as s\n"
            "from nanoserve.tokenizer import default_model, load_tokenizer\n"
            "assert s.llguidance is None\n"
            "assert s.tool_call_outputs([{'type': 'function', 'function': {'name': 'f'}}], 'auto') is None\n"
            "print(s.parse_tool_calls('<tool_call>{\"name\": \"f\"}</tool_call>'))\n"
            "tok = load_tokenizer(default_model()); c = s.GrammarCompiler(tok, len(tok))\n"
            "try: c.compile(s.StructuredOutputs(regex='a'))\n"
            "except ValueError as e: print('ERROR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[{'name': 'f', 'arguments': '{}'}]" in r.stdout
    assert "ERROR structured output needs llguidance, which is not installed: pip install 'nanoserve[structured]'" in r.stdout


def test_qwen_tool_call_tokens_are_text():
    "Qwen2.5's <tool_call> / </tool_call> are non-special added tokens: text that a grammar matches, as one token or in pieces."
    tok = load_tokenizer(default_model())
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    c = GrammarCompiler(tok, len(tok) + 5)
    open_id, close_id = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    ids = tok.encode(text)
    assert ids[0] == open_id and ids[-1] == close_id
    spec = tool_call_outputs([CLOCK], "required")
    m = c.compile(spec).matcher()
    mask = torch.zeros(1, c.bitmask_width, dtype=torch.int32)
    m.fill_bitmask(mask, 0)
    assert [tok.decode([t]) for t in allowed(mask, 0)] == ["<"]     # forced text: llguidance's canonical pieces
    assert all(m.accept(t) for t in ids) and m.is_accepting()       # the one-token tags are accepted too
    m.fill_bitmask(mask, 0)
    assert set(allowed(mask, 0)) <= {tok.eos_token_id} | set(tok.encode("\n")) | {open_id}
    specials = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"])
    m = c.compile(StructuredOutputs(regex="[^x]*")).matcher()
    m.fill_bitmask(mask, 0)
    assert open_id in allowed(mask, 0) and not set(specials) & set(allowed(mask, 0))   # special ones are never text
    assert parse_tool_calls(tok.decode(ids)) == ("", [{"name": "get_time", "arguments": "{}"}])

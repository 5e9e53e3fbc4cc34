"""nanoserve.tokenizer: the built-in tiny Qwen2 folder, tokenizer loading, incremental detokenization."""
import hashlib
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import nanoserve.tokenizer as T
from nanoserve.tokenizer import (IM_END, IM_START, ENDOFTEXT, REPLACEMENT_CHAR, TINY_MODEL_NAME, ByteDetokenizer,
                                 IncrementalDetokenizer, build_tiny_model, byte_level_table, default_model_dir, ensure_default_model, is_model_folder,
                                 load_tokenizer, tiny_corpus)

ROOT = Path(__file__).resolve().parents[1]
VARIED_TEXT = ("def f(x):\n    return x**2  # square\n\n\n\tclass A:  pass\r\n"
               "It's 3.14159, isn't it? 1,000,000 and 2026-11-29 at 07:35:25.\n"
               "Ünïcödé café, cafe\u0301 (decomposed), naïve; Ελληνικά, русский, 日本語のテキスト, 你好，世界！\n"
               "Emoji: 🙂🚀👍🏽 👨‍👩‍👧 and symbols → ≤ ∑ ★ ☺\n"
               "whitespace:     four   three  two\t\ttabs\n\n\n   \n" + ENDOFTEXT + IM_START + "user\nhi" + IM_END)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("built") / TINY_MODEL_NAME)


@pytest.fixture(scope="module")
def hf_tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def _bytes(folder, name):
    return (Path(folder) / name).read_bytes()


# -- the folder ---------------------------------------------------------------------------------------------

def test_folder_files_and_config(tiny_dir):
    assert is_model_folder(tiny_dir)
    cfg = json.loads(_bytes(tiny_dir, "config.json"))
    expect = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=3072, hidden_size=64,
                  intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32",
                  bos_token_id=3069, eos_token_id=3069)
    assert {k: cfg[k] for k in expect} == expect
    assert cfg["rope_parameters"]["rope_theta"] == 1e6
    gen = json.loads(_bytes(tiny_dir, "generation_config.json"))
    assert gen["eos_token_id"] == [3071, 3069] and gen["pad_token_id"] == 3069
    from safetensors import safe_open
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        assert "lm_head.weight" not in names
        assert names == set(T.hf_weight_shapes(cfg))
        assert f.get_tensor("model.layers.1.mlp.down_proj.weight").shape == (64, 176)


def test_transformers_loads_the_folder(tiny_dir, hf_tok):
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM   # test-only use of a model class
    model, info = Qwen2ForCausalLM.from_pretrained(str(tiny_dir), output_loading_info=True)
    assert all(not v for v in info.values()), info   # no missing / unexpected / mismatched keys, no errors
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()   # tied
    from safetensors.torch import load_file
    for name, tensor in load_file(str(tiny_dir / "model.safetensors")).items():
        assert torch.equal(model.state_dict()[name], tensor), name
    ids = torch.tensor([hf_tok("Hello, world! 你好 🙂")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 3072) and torch.isfinite(logits).all()
    assert GenerationConfig.from_pretrained(str(tiny_dir)).eos_token_id == [3071, 3069]


def test_autotokenizer_ids_equal_raw_tokenizer_ids(tiny_dir, hf_tok):
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert type(hf_tok).__name__ == "Qwen2Tokenizer"
    assert len(hf_tok) == raw.get_vocab_size() == 3072
    for text in [VARIED_TEXT, *VARIED_TEXT.splitlines(), " leading space", "trailing\n", "   ", "1234567890"]:
        assert hf_tok(text)["input_ids"] == raw.encode(text).ids, text
    ids = raw.encode(VARIED_TEXT).ids
    assert [raw.token_to_id(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [3069, 3070, 3071]
    assert {3069, 3070, 3071} <= set(ids)   # special tokens in text are matched whole
    assert hf_tok.decode(ids) == raw.decode(ids, skip_special_tokens=False)
    assert hf_tok.eos_token == IM_END and hf_tok.pad_token == ENDOFTEXT and hf_tok.bos_token is None


def test_chat_template(hf_tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "?"}]
    text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n?<|im_end|>\n<|im_start|>assistant\n")
    own_system = [{"role": "system", "content": "Be brief."}] + msgs[:1]
    assert hf_tok.apply_chat_template(own_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


# -- determinism ----------------------------------------------------------------------------------------------

def test_corpus_is_frozen():
    # the corpus must be the same bytes on every Python version; changing it means a new TINY_MODEL_NAME
    digest = hashlib.sha256("".join(tiny_corpus()).encode()).hexdigest()
    assert digest == "e766107db4896b10557a811b0f7783d8d0c391e9fb6ef311df19bf4da4c77022"


def test_build_is_deterministic(tiny_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    for name in T.MODEL_FILES:
        assert _bytes(again, name) == _bytes(tiny_dir, name), name
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    assert _bytes(other, "tokenizer.json") == _bytes(tiny_dir, "tokenizer.json")
    assert _bytes(other, "model.safetensors") != _bytes(tiny_dir, "model.safetensors")


def test_build_refuses_an_existing_path(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="taken"):
        build_tiny_model(tmp_path / "taken")


# -- the cache folder and races -------------------------------------------------------------------------------

def test_default_model_dir_honours_nanoserve_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "c"))
    assert default_model_dir() == tmp_path / "c" / TINY_MODEL_NAME
    assert not default_model_dir().exists()            # only ensure_default_model builds
    monkeypatch.delenv("NANOSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_dir() == tmp_path / "home" / ".cache" / "nanoserve" / TINY_MODEL_NAME


def test_ensure_default_model_builds_once(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    path = ensure_default_model()
    assert path == tmp_path / TINY_MODEL_NAME and is_model_folder(path)
    assert _bytes(path, "model.safetensors") == _bytes(tiny_dir, "model.safetensors")
    mtime = (path / "config.json").stat().st_mtime_ns
    assert ensure_default_model() == path and (path / "config.json").stat().st_mtime_ns == mtime


def test_ensure_default_model_rejects_a_broken_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    (tmp_path / TINY_MODEL_NAME).mkdir()
    (tmp_path / TINY_MODEL_NAME / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match=TINY_MODEL_NAME):
        ensure_default_model()


def test_race_between_threads_leaves_one_folder(tiny_dir, tmp_path, monkeypatch):
    # both threads finish writing their temp folders before either renames: a guaranteed race
    barrier, calls, write = threading.Barrier(2, timeout=60), [], T._write_tiny_model
    def write_then_wait(folder, seed):
        write(folder, seed); calls.append(folder); barrier.wait()
    monkeypatch.setattr(T, "_write_tiny_model", write_then_wait)
    target, results, errors = tmp_path / TINY_MODEL_NAME, [], []
    def build():
        try: results.append(build_tiny_model(target))
        except BaseException as e: errors.append(e)
    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors and results == [target, target] and len(calls) == 2
    assert [p.name for p in tmp_path.iterdir()] == [TINY_MODEL_NAME]   # the loser's temp folder is gone
    for name in T.MODEL_FILES:
        assert _bytes(target, name) == _bytes(tiny_dir, name)


RACER = """
import sys, time
from pathlib import Path
import torch, transformers, safetensors.torch
from nanoserve.tokenizer import ensure_default_model
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists(): time.sleep(0.005)
print(ensure_default_model())
"""


def test_race_between_processes_leaves_one_valid_folder(tiny_dir, tmp_path):
    cache, sync = tmp_path / "cache", tmp_path / "sync"
    sync.mkdir()
    env = {**__import__("os").environ, "NANOSERVE_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(sync / f"ready{i}"), str(sync / "go")],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    deadline = time.time() + 40
    while not all((sync / f"ready{i}").exists() for i in range(2)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "racers did not start"
        time.sleep(0.01)
    (sync / "go").touch()
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip().splitlines()[-1] for o, _ in outs] == [str(cache / TINY_MODEL_NAME)] * 2
    assert [p.name for p in cache.iterdir()] == [TINY_MODEL_NAME]
    for name in T.MODEL_FILES:   # built in other processes, byte for byte the same (config.json included)
        assert _bytes(cache / TINY_MODEL_NAME, name) == _bytes(tiny_dir, name), name


# -- loading errors -------------------------------------------------------------------------------------------

def test_load_tokenizer_names_the_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_tokenizer(tmp_path / "no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json") as e:
        load_tokenizer(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(e.value)


# -- incremental detokenization -------------------------------------------------------------------------------

def _stream(tok, ids, prompt=None, skip=True):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [d.add(t) for t in ids]
    tail = d.flush()
    assert d.text == "".join(deltas) + tail
    return deltas, tail, d


def test_detokenizer_streams_split_characters(hf_tok):
    for text in ["🙂", "👨‍👩‍👧!", "a界b", "é", "日本語のテキスト", "x \U0001F680\U0001F680 y"]:
        ids = hf_tok(text)["input_ids"]
        deltas, tail, _ = _stream(hf_tok, ids)
        assert "".join(deltas) == text and tail == ""
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_detokenizer_equals_full_decode_on_random_ids(hf_tok):
    rng = random.Random(1234)
    vocab = len(hf_tok)
    single_bytes = [i for i in range(vocab) if len(hf_tok.convert_ids_to_tokens(i)) == 1]
    nasty = single_bytes + [3069, 3070, 3071] * 8 + list(range(256, 600))   # bytes, specials, short merges
    for n in range(1500):
        pool = nasty if n % 3 else range(vocab)
        ids = [rng.choice(pool) for _ in range(rng.randrange(0, 40))]
        prompt = [rng.choice(pool) for _ in range(rng.randrange(0, 10))] if n % 2 else None
        skip = n % 4 < 2
        deltas, _, d = _stream(hf_tok, ids, prompt, skip)
        assert d.text == hf_tok.decode(ids, skip_special_tokens=skip), (ids, prompt, skip)
        assert not any(x.endswith(REPLACEMENT_CHAR) for x in deltas)   # add() never ends on a half character


def test_detokenizer_with_chat_prompt_and_real_text(hf_tok):
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "Say hi"}], add_generation_prompt=True)["input_ids"]
    out = hf_tok(VARIED_TEXT)["input_ids"] + [hf_tok.convert_tokens_to_ids(IM_END)]
    for skip in (True, False):
        deltas, tail, d = _stream(hf_tok, out, prompt, skip)
        assert d.text == hf_tok.decode(out, skip_special_tokens=skip) and tail == ""
    assert IM_END not in _stream(hf_tok, out, prompt, True)[2].text


def test_detokenizer_window_stays_short(hf_tok):
    ids = hf_tok("The quick brown fox 跳过 the lazy dog 🙂. " * 60)["input_ids"]
    d = IncrementalDetokenizer(hf_tok)
    longest = 0
    for t in ids:
        d.add(t)
        longest = max(longest, len(d._window))
    assert longest <= 5 and d.num_tokens == len(ids)


def test_detokenizer_accepts_a_raw_tokenizer_and_a_prompt_ending_mid_character(tiny_dir, hf_tok):
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    emoji = raw.encode("🙂").ids
    prompt = raw.encode("hello ").ids + emoji[:2]       # the prompt stops inside the emoji
    out = emoji[2:] + raw.encode(" ok").ids
    deltas, tail, d = _stream(raw, out, prompt)
    assert d.text == raw.decode(out) and d.text.startswith(REPLACEMENT_CHAR)


# -- byte-level BPE's table of bytes ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def raw_tok(tiny_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def test_byte_detokenizer_equals_full_decode_on_random_ids(raw_tok):
    rng = random.Random(99)
    vocab = raw_tok.get_vocab_size()
    tables = {skip: byte_level_table(raw_tok, skip) for skip in (True, False)}
    single_bytes = [i for i in range(vocab) if len(raw_tok.id_to_token(i)) == 1]
    nasty = single_bytes + [3069, 3070, 3071] * 8 + list(range(256, 600)) + [vocab + 5]   # bytes, specials, merges, past the end
    for n in range(2000):
        pool = nasty if n % 3 else range(vocab)
        ids = [rng.choice(pool) for _ in range(rng.randrange(0, 40))]
        skip = n % 4 < 2
        d = ByteDetokenizer(tables[skip])
        deltas = [d.add(t) for t in ids]
        assert "".join(deltas) + d.flush() == d.text == raw_tok.decode(ids, skip_special_tokens=skip), (ids, skip)
        assert d.num_tokens == len(ids)
        d, cut = ByteDetokenizer(tables[skip]), rng.randrange(0, len(ids) + 1)
        assert d.extend(ids[:cut]) + d.extend(ids[cut:]) + d.flush() == raw_tok.decode(ids, skip_special_tokens=skip)


def test_byte_detokenizer_streams_real_text_and_holds_half_characters(raw_tok):
    ids = raw_tok.encode(VARIED_TEXT).ids
    d = ByteDetokenizer(byte_level_table(raw_tok))
    deltas = [d.add(t) for t in ids]
    assert d.text + d.flush() == raw_tok.decode(ids)
    assert not any(REPLACEMENT_CHAR in x for x in deltas)      # valid text: never a half character sent
    emoji = raw_tok.encode("🙂").ids
    d = ByteDetokenizer(byte_level_table(raw_tok))
    assert [d.add(t) for t in emoji] == [""] * (len(emoji) - 1) + ["🙂"]


def test_byte_level_table_only_for_byte_level_decoders(raw_tok):
    from tokenizers import Tokenizer, decoders, models
    sp = Tokenizer(models.BPE(vocab={"▁a": 0, "b": 1}, merges=[]))
    sp.decoder = decoders.Metaspace()
    assert byte_level_table(sp) is None
    assert byte_level_table(object()) is None                  # no decoder at all
    table = byte_level_table(raw_tok)
    assert len(table) == raw_tok.get_vocab_size() and table[raw_tok.token_to_id(IM_END)] == b""


def test_engine_detokenizes_through_the_table_when_it_has_one(tiny_dir):
    from nanoserve.engine import LLM
    from nanoserve.params import SamplingParams
    llm = LLM(tiny_dir, max_num_seqs=4, num_kv_blocks=64)
    assert llm._byte_table is not None and isinstance(llm._detokenizer([1, 2]), ByteDetokenizer)
    out = llm.generate(["Hello, world"], SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    llm._byte_table = None                                     # the window: the same text
    assert isinstance(llm._detokenizer([1, 2]), IncrementalDetokenizer)
    again = llm.generate(["Hello, world"], SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert (again.token_ids, again.text) == (out.token_ids, out.text)

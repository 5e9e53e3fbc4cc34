"""nanoserve.bench: workloads, Poisson send times, percentiles and summaries, engine names, end-to-end runs of the
engines in fresh processes on the CPU (offline, online, a failing engine), the CLI, and the profiler's paused clock.

The built-in tiny model is built into a per-session NANOSERVE_CACHE (never ~/.cache); the workers run in
subprocesses and inherit os.environ, so they find it there too.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import pytest

import nanoserve.bench as bench
from nanoserve.bench import (BenchRequest, WorkloadSpec, make_workload, parse_engine, percentile, plot_results,
                             poisson_send_times, report, run_benchmark, run_nanoserve, summarize)

VOCAB, CTX = 3072, 2048          # the built-in tiny model's vocabulary and context
PCTS = ("p50", "p90", "p99")


@pytest.fixture(scope="session")
def bench_env(tmp_path_factory):
    "NANOSERVE_CACHE (and a headless matplotlib) for the whole session, in os.environ so that the workers see it."
    path = tmp_path_factory.mktemp("nanoserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOSERVE_CACHE", str(path))
        mp.setenv("MPLBACKEND", "Agg")
        yield path


@pytest.fixture(scope="session")
def model_dir(bench_env):
    from nanoserve.tokenizer import ensure_default_model
    path = ensure_default_model()
    assert Path(bench_env) in path.parents
    return path


# --- workloads ---------------------------------------------------------------------------------------------------

def test_lognormal_is_seeded_reproducible_and_clipped():
    spec = WorkloadSpec(num_requests=300, seed=5, prompt_median=64, output_median=32, prompt_max=400, output_max=200)
    a, b = make_workload(spec, VOCAB, CTX), make_workload(spec, VOCAB, CTX)
    assert a == b and len(a) == 300
    assert make_workload(WorkloadSpec(num_requests=300, seed=6, prompt_median=64, output_median=32, prompt_max=400,
                                      output_max=200), VOCAB, CTX) != a
    assert all(4 <= len(r.prompt_token_ids) <= 400 and 1 <= r.max_tokens <= 200 for r in a)
    assert all(0 <= t < VOCAB for r in a for t in r.prompt_token_ids)
    assert len({len(r.prompt_token_ids) for r in a}) > 50           # spread out, not one length
    assert 0.75 * 64 < statistics.median(len(r.prompt_token_ids) for r in a) < 1.33 * 64
    assert 0.75 * 32 < statistics.median(r.max_tokens for r in a) < 1.33 * 32


def test_lognormal_sigma_zero_gives_the_medians():
    reqs = make_workload(WorkloadSpec(num_requests=5, sigma=0.0, prompt_median=20, output_median=7), VOCAB, CTX)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in reqs] == [(20, 7)] * 5


def test_nanovllm_workload():
    reqs = make_workload(WorkloadSpec(kind="nanovllm"), VOCAB, CTX)
    assert len(reqs) == 256
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in reqs)
    assert len({len(r.prompt_token_ids) for r in reqs}) > 100
    assert reqs == make_workload(WorkloadSpec(kind="nanovllm"), VOCAB, CTX)


def write_lines(path: Path, lines) -> Path:
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return path


def test_file_workload(tmp_path):
    f = write_lines(tmp_path / "w.jsonl", [{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}, "",
                                           {"prompt_len": 9, "max_tokens": 2}, "   ",
                                           {"prompt_token_ids": [0, VOCAB - 1], "max_tokens": 1}])
    reqs = make_workload(WorkloadSpec(kind="file", path=str(f)), VOCAB, CTX)
    assert reqs[0] == BenchRequest((5, 6, 7), 4)
    assert len(reqs[1].prompt_token_ids) == 9 and reqs[1].max_tokens == 2
    assert all(0 <= t < VOCAB for t in reqs[1].prompt_token_ids)
    assert reqs[2] == BenchRequest((0, VOCAB - 1), 1)
    assert len(reqs) == 3                                   # blank lines are skipped
    assert make_workload(WorkloadSpec(kind="file", path=str(f)), VOCAB, CTX) == reqs   # the drawn prompt is seeded


def test_workload_over_the_context_is_refused():
    with pytest.raises(ValueError, match="exceeds the context of 64"):
        make_workload(WorkloadSpec(num_requests=4, sigma=0.0, prompt_median=60, output_median=10), VOCAB, 64)
    # exactly the context is fine
    make_workload(WorkloadSpec(num_requests=4, sigma=0.0, prompt_median=54, output_median=10), VOCAB, 64)


@pytest.mark.parametrize("lines, match", [
    ([], "has no requests"),
    (["", "  "], "has no requests"),
    ([{"prompt_len": 3, "max_tokens": 2}, "{not json"], r":2: not JSON"),
    ([{"prompt_len": 3}], r":1: no max_tokens"),
    ([{"prompt_token_ids": [1, VOCAB], "max_tokens": 2}], "outside the vocabulary of 3072"),
    ([{"prompt_token_ids": [-1, 2], "max_tokens": 2}], "outside the vocabulary"),
    ([{"prompt_token_ids": [1, 2], "max_tokens": 0}], "max_tokens < 1"),
    ([{"prompt_len": 0, "max_tokens": 2}], "empty prompt"),
    ([{"prompt_len": 2000, "max_tokens": 100}], "exceeds the context"),
])
def test_bad_workload_files(tmp_path, lines, match):
    f = tmp_path / "w.jsonl"
    if lines: write_lines(f, lines)
    else: f.write_text("")
    with pytest.raises(ValueError, match=match):
        make_workload(WorkloadSpec(kind="file", path=str(f)), VOCAB, CTX)


def test_missing_workload_file(tmp_path):
    with pytest.raises(ValueError, match="workload file not found"):
        make_workload(WorkloadSpec(kind="file", path=str(tmp_path / "nope.jsonl")), VOCAB, CTX)
    with pytest.raises(ValueError, match="needs a path"):
        WorkloadSpec(kind="file")


@pytest.mark.parametrize("line", ["null", "5", '[1, 2, 3]'])
def test_workload_line_that_is_not_an_object_is_a_clear_value_error(tmp_path, line):
    "Valid JSON that is not an object must be refused like bad JSON (a ValueError naming the line)."
    f = write_lines(tmp_path / "w.jsonl", [{"prompt_len": 3, "max_tokens": 2}, line])
    with pytest.raises(ValueError, match=":2:"):
        make_workload(WorkloadSpec(kind="file", path=str(f)), VOCAB, CTX)


@pytest.mark.parametrize("record", [{"prompt_token_ids": ["a", "b"], "max_tokens": 2},
                                    {"prompt_token_ids": [1.5, 2], "max_tokens": 2},
                                    {"prompt_token_ids": 7, "max_tokens": 2},
                                    {"prompt_len": 3, "max_tokens": "many"}])
def test_workload_records_of_the_wrong_type_are_a_clear_value_error(tmp_path, record):
    "Token ids must be integers, max_tokens a number: anything else is a ValueError naming the line."
    f = write_lines(tmp_path / "w.jsonl", [record])
    with pytest.raises(ValueError, match=r"(:1:|request 0)"):
        make_workload(WorkloadSpec(kind="file", path=str(f)), VOCAB, CTX)


@pytest.mark.parametrize("kw, match", [
    (dict(num_requests=0), "num_requests must be >= 1"),
    (dict(num_requests=-3), "num_requests must be >= 1"),
    (dict(prompt_min=10, prompt_max=9), "clip ranges"),
    (dict(prompt_min=0), "clip ranges"),
    (dict(output_min=0), "clip ranges"),
    (dict(output_min=5, output_max=4), "clip ranges"),
    (dict(prompt_median=0), "medians must be > 0"),
    (dict(sigma=-0.1), "sigma >= 0"),
    (dict(kind="zipf"), "workload kind"),
])
def test_bad_specs(kw, match):
    with pytest.raises(ValueError, match=match):
        WorkloadSpec(**kw)


# --- Poisson send times ------------------------------------------------------------------------------------------

def test_poisson_send_times():
    t = poisson_send_times(20000, 40.0, seed=3)
    assert len(t) == 20000 and t[0] > 0
    assert all(b > a for a, b in zip(t, t[1:]))
    assert len(t) / t[-1] == pytest.approx(40.0, rel=0.05)
    assert poisson_send_times(50, 2.0, seed=1) == poisson_send_times(50, 2.0, seed=1)
    assert poisson_send_times(50, 2.0, seed=1) != poisson_send_times(50, 2.0, seed=2)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert statistics.pstdev(gaps) == pytest.approx(1 / 40.0, rel=0.1)    # exponential: sd == mean


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan")])
def test_poisson_rate_must_be_positive(rate):
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_send_times(10, rate)


# --- percentiles and summaries -----------------------------------------------------------------------------------

def test_percentile():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0.0) == 1.0 and percentile(xs, 1.0) == 4.0
    assert percentile(xs, 0.5) == pytest.approx(2.5)
    assert percentile(xs, 0.9) == pytest.approx(3.7)
    assert percentile(list(range(101)), 0.99) == pytest.approx(99.0)
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None and percentile([None, None], 0.5) is None
    assert percentile([None, 1.0, None, 3.0], 0.5) == pytest.approx(2.0)


def test_summarize():
    per = [{"num_output_tokens": 1, "ttft_s": 0.1, "e2e_s": 0.1},     # one token: no TPOT (and no division by 0)
           {"num_output_tokens": 5, "ttft_s": 0.2, "e2e_s": 1.0},     # TPOT 0.2
           {"num_output_tokens": 3, "ttft_s": 0.5, "e2e_s": 1.1},     # TPOT 0.3
           {"num_output_tokens": 4, "ttft_s": None, "e2e_s": 2.0}]    # no TTFT measured: no TPOT, no TTFT
    s = summarize(per, 2.5)
    assert s["num_requests"] == 4 and s["output_tokens"] == 13 and s["wall_s"] == 2.5
    assert s["output_tokens_per_s"] == pytest.approx(13 / 2.5)
    assert s["tpot_p50_s"] == pytest.approx(0.25) and s["tpot_p99_s"] == pytest.approx(0.299)
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["ttft_p90_s"] == pytest.approx(0.44)
    assert s["e2e_p50_s"] == pytest.approx(1.05)
    for name in ("ttft", "tpot", "e2e"):
        assert all(f"{name}_{p}_s" in s for p in PCTS)
    assert summarize(per, 0.0)["output_tokens_per_s"] is None
    assert summarize([per[0]], 1.0)["tpot_p50_s"] is None


# --- engine names ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, want", [("continuous", ("continuous", None)), ("static:2", ("static", 2)),
                                        ("static:64", ("static", 64)), ("hf-static:8", ("hf-static", 8)),
                                        ("hf-cb", ("hf-cb", None)), ("continuous-eager", ("continuous-eager", None)),
                                        ("static-eager:8", ("static-eager", 8))])
def test_parse_engine(name, want):
    assert parse_engine(name) == want


@pytest.mark.parametrize("name", ["static:0", "static", "static:", "static:-1", "static:x", "hf-static", "foo",
                                  "hf-cb:3", "continuous:4", "", "Continuous",
                                  "hf-cb-eager", "static-eager", "eager"])
def test_parse_engine_rejects(name):
    with pytest.raises(ValueError, match="unknown engine"):
        parse_engine(name)


# --- end to end on the CPU ---------------------------------------------------------------------------------------

SMALL = WorkloadSpec(num_requests=4, seed=1, prompt_median=12, output_median=5, sigma=0.5, prompt_max=24,
                     output_min=2, output_max=8)
# static:32 needs max_num_seqs 32 > max_num_batched_tokens 16, which the scheduler config refuses: its worker fails
KW = {"device": "cpu", "max_num_seqs": 4, "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def offline(model_dir):
    return run_benchmark(model_dir, SMALL, ["continuous", "static:32", "static:2"], engine_kwargs=KW, repeats=2,
                         warmup_s=0, progress=False)


@pytest.fixture(scope="module")
def online(model_dir):
    return run_benchmark(model_dir, SMALL, ["continuous"], rates=[50.0], engine_kwargs=KW, repeats=2, warmup_s=0,
                         progress=False)


def check_reps(run, requests):
    assert len(run["reps"]) == 2 and len(run["output_tokens_per_s"]) == 2 and isinstance(run["disagree"], bool)
    for rep in run["reps"]:
        assert [r["num_output_tokens"] for r in rep["per_request"]] == [r.max_tokens for r in requests]
        s = rep["summary"]
        assert s["output_tokens"] == sum(r.max_tokens for r in requests) and s["num_requests"] == len(requests)
        for name in ("ttft", "tpot", "e2e"):
            for p in PCTS: assert s[f"{name}_{p}_s"] is not None and s[f"{name}_{p}_s"] >= 0
        assert s["output_tokens_per_s"] > 0
        assert rep["wall_s"] == pytest.approx(max(r["e2e_s"] + r["send_s"] for r in rep["per_request"]))
        assert all(0 <= r["ttft_s"] <= r["e2e_s"] for r in rep["per_request"])
    assert run["output_tokens_per_s"] == [rep["summary"]["output_tokens_per_s"] for rep in run["reps"]]


def test_offline_runs(offline):
    requests = make_workload(SMALL, VOCAB, CTX)
    assert offline["num_output_tokens_requested"] == sum(r.max_tokens for r in requests)
    assert [(r["mode"], r["engine"]) for r in offline["runs"]] == [("offline", "continuous"), ("offline", "static:32"),
                                                                    ("offline", "static:2")]
    for run in (offline["runs"][0], offline["runs"][2]):
        assert run["rate"] is None
        check_reps(run, requests)
        assert all(r["send_s"] == 0.0 for rep in run["reps"] for r in rep["per_request"])
        assert run["reps"][0]["ledger"]["steps"] > 0
    assert offline["workload"]["num_requests"] == 4 and offline["engine_kwargs"] == KW
    assert "meta" in offline and "git_sha" in offline["meta"]


def test_failing_engine_is_recorded_and_the_others_still_run(offline):
    err = offline["runs"][1]
    assert err["engine"] == "static:32" and "reps" not in err
    assert "worker for static:32 failed" in err["error"] and "max_num_batched_tokens (16)" in err["error"]
    assert "reps" in offline["runs"][2]                  # the engine after the failing one ran
    lines = report(offline).splitlines()
    failed = [l for l in lines if "FAILED" in l]
    assert len(failed) == 1 and "static:32" in failed[0] and "max_num_batched_tokens" in failed[0]
    assert any("continuous" in l and "FAILED" not in l for l in lines[2:])
    assert any("static:2" in l and "FAILED" not in l for l in lines[2:])


def test_online_run_measures_from_the_scheduled_send_time(online):
    requests = make_workload(SMALL, VOCAB, CTX)
    send = poisson_send_times(len(requests), 50.0, SMALL.seed)
    (run,) = online["runs"]
    assert run["mode"] == "poisson@50" and run["rate"] == 50.0
    check_reps(run, requests)
    for rep in run["reps"]:
        per = rep["per_request"]
        assert [r["send_s"] for r in per] == pytest.approx(send)
        assert all(b["send_s"] > a["send_s"] for a, b in zip(per, per[1:]))
        assert all(r["ttft_s"] >= 0 for r in per)
        assert rep["wall_s"] >= send[-1]


def test_report_and_plots(offline, online, tmp_path):
    text = report(online)
    assert "poisson@50" in text and "FAILED" not in text
    figs = plot_results({**offline, "runs": offline["runs"] + online["runs"]}, tmp_path, prefix="x")
    assert set(figs) == {"throughput", "ttft_cdf", "ledger"}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["x_ledger.png", "x_throughput.png", "x_ttft_cdf.png"]
    import matplotlib.pyplot as plt
    for f in figs.values(): plt.close(f)


# --- the CLI -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--rate", "0"], "request rate must be > 0"),
    (["--rate", "5", "-1"], "request rate must be > 0"),
    (["--workload", "/nonexistent/w.jsonl"], "workload file not found"),
    (["--engines", "continuous,foo"], "unknown engine 'foo'"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--profile-steps", "-1"], "--profile-steps must be >= 0"),
    (["--prompt-max", "2"], "clip ranges"),
])
def test_cli_errors(model_dir, capsys, monkeypatch, argv, match):
    monkeypatch.setattr(bench, "_spawn", lambda *a, **k: pytest.fail("no worker may start"))
    assert bench.main(argv + ["--device", "cpu", "--warmup", "0"]) == 2
    err = capsys.readouterr().err
    assert "nanoserve bench: error:" in err and match in err


def test_cli_num_requests_zero_is_an_error(model_dir, capsys, monkeypatch):
    "--num-requests 0 must be refused, not silently replaced by the default 256 (`args.num_requests or 256`)."
    specs = []
    def fake_run_benchmark(model_dir, spec, *a, **k):
        specs.append(spec); raise ValueError("fake run_benchmark reached")
    monkeypatch.setattr(bench, "run_benchmark", fake_run_benchmark)
    assert bench.main(["--num-requests", "0", "--device", "cpu"]) == 2
    assert specs == [], f"ran with num_requests={specs[0].num_requests}"
    assert "num_requests" in capsys.readouterr().err


def test_cli_workload_file_of_the_wrong_shape_exits_2(model_dir, tmp_path, capsys, monkeypatch):
    "A workload line that is JSON but not an object must give exit status 2 and a message, not a traceback."
    monkeypatch.setattr(bench, "_spawn", lambda *a, **k: pytest.fail("no worker may start"))
    f = write_lines(tmp_path / "w.jsonl", [{"prompt_len": 3, "max_tokens": 2}, "null"])
    assert bench.main(["--workload", str(f), "--device", "cpu", "--warmup", "0"]) == 2
    assert "w.jsonl:2" in capsys.readouterr().err


def test_cli_run_writes_json_and_plots(model_dir, tmp_path, capsys):
    out = tmp_path / "res.json"
    rc = bench.main(["--engines", "continuous", "--num-requests", "3", "--prompt-median", "8", "--output-median", "4",
                     "--prompt-max", "16", "--output-max", "6", "--repeats", "1", "--warmup", "0", "--device", "cpu",
                     "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--out", str(out), "--plot",
                     "--scheduling", "async", "--no-mixed-step-graphs", "--no-row-gemv", "--no-pdl"])
    assert rc == 0
    res = json.loads(out.read_text())
    (run,) = res["runs"]
    assert run["engine"] == "continuous" and len(run["reps"]) == 1
    assert run["reps"][0]["summary"]["output_tokens"] == res["num_output_tokens_requested"]
    config = run["reps"][0]["engine_config"]             # the engine's whole configuration, as it ran
    assert isinstance(config, dict) and json.loads(json.dumps(config)) == config
    assert res["command"].startswith("nanoserve bench --engines continuous")
    assert res["engine_kwargs"]["device"] == "cpu"
    assert res["engine_kwargs"]["async_scheduling"] is True and res["engine_kwargs"]["mixed_step_graphs"] is False
    assert res["engine_kwargs"]["row_gemv"] is False and res["engine_kwargs"]["pdl"] is False
    stdout = capsys.readouterr().out
    assert f"results: {out}" in stdout and "continuous" in stdout
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert "res_throughput.png" in pngs and "res_ledger.png" in pngs


# --- the profiler's paused clock ---------------------------------------------------------------------------------

PAUSE = 0.5


class FakeRun:
    events: list = []


class FakeProfile:
    "Stands in for measure.profile_run: starting and stopping take PAUSE seconds each, and it records nothing."
    def __init__(self, device=None): self.entered = self.exited = 0
    def __enter__(self):
        time.sleep(PAUSE); self.entered += 1
        return FakeRun()
    def __exit__(self, *exc):
        time.sleep(PAUSE); self.exited += 1
        return False


@pytest.fixture
def spoof_cuda(model_dir, monkeypatch):
    """run_nanoserve opens its profile window only when `llm.device.type == "cuda"`: an LLM on the CPU that says it
    is on CUDA once built (the model runner keeps the real device), the profiler faked. The benchmark module
    imports LLM, profile_run and busy_share at its top, so they are patched there."""
    import torch
    built, profs = [], []

    class CudaLookingLLM(bench.LLM):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.device = torch.device("cuda")
            built.append(self)

    def fake_profile_run(device=None, include_memory=False):
        profs.append(FakeProfile(device)); return profs[-1]

    monkeypatch.setattr(bench, "LLM", CudaLookingLLM)
    monkeypatch.setattr(bench, "profile_run", fake_profile_run)
    monkeypatch.setattr(bench, "busy_share", lambda run, *a, **k: 0.0)
    return built, profs


def test_profiler_pauses_are_taken_out_of_wall_time_and_ledger(model_dir, spoof_cuda):
    built, profs = spoof_cuda
    reqs = [BenchRequest(tuple(range(10 + i, 20 + 2 * i)), 12) for i in range(3)]
    t0 = time.perf_counter()
    res = run_nanoserve(model_dir, reqs, None, engine_kwargs={"device": "cpu", "max_num_seqs": 4}, warmup_s=0,
                        profile_after=2, profile_steps=3)
    elapsed = time.perf_counter() - t0
    (llm,) = built
    assert len(profs) == 1 and profs[0].entered == profs[0].exited == 1
    prof = res["profile"]
    assert prof["steps"] == 3 and prof["decode_only"] and prof["gpu_busy"] == 0.0 and prof["kernels_per_step"] == 0
    assert prof["paused_s"] >= 2 * PAUSE
    assert [r["num_output_tokens"] for r in res["per_request"]] == [12, 12, 12]
    # the paused clock: the wall time leaves out the two pauses; it is the time the steps took (and the gaps
    # between them), which the ledger adds up independently of the clock
    assert res["wall_s"] <= elapsed - 2 * PAUSE
    assert res["wall_s"] == pytest.approx(sum(r["total"] for r in llm.ledger.rows), abs=PAUSE / 5)
    assert all(r["e2e_s"] <= res["wall_s"] + 1e-9 and 0 <= r["ttft_s"] <= r["e2e_s"] for r in res["per_request"])
    # and the ledger's gaps leave them out too
    gaps = [r["gap"] for r in llm.ledger.rows]
    assert max(gaps) < PAUSE / 5, f"a ledger gap of {max(gaps):.3f} s holds a profiler pause"
    assert res["ledger"]["gap"] * res["ledger"]["steps"] < PAUSE / 5
    assert sum(r["total"] for r in llm.ledger.rows) <= elapsed - 2 * PAUSE


def test_warmup_is_not_counted_in_the_ledger_gap(model_dir, monkeypatch):
    """The ledger is reset after the warm-up, but `llm._last_step_end` still holds the end of the warm-up
    `generate`, so the first measured step's gap holds the whole warm-up (warm_gpu: 3 s by default on a GPU)."""
    monkeypatch.setattr(bench, "warm_gpu", lambda seconds=3.0, device=None, size=8192: time.sleep(seconds) or 0)
    reqs = [BenchRequest((1, 2, 3, 4, 5), 6), BenchRequest((6, 7, 8), 6)]
    res = run_nanoserve(model_dir, reqs, None, engine_kwargs={"device": "cpu"}, warmup_s=PAUSE)
    assert [r["num_output_tokens"] for r in res["per_request"]] == [6, 6]
    total_gap = res["ledger"]["gap"] * res["ledger"]["steps"]
    assert total_gap < PAUSE / 5, f"the ledger's gaps add up to {total_gap:.3f} s: the {PAUSE} s warm-up is in them"


def test_cli_out_folder_gets_the_default_name(model_dir, tmp_path):
    "`--out` naming a folder writes the results there under the default name (it used to fail after the run)."
    rc = bench.main(["--model", str(model_dir), "--engines", "continuous", "--num-requests", "2", "--prompt-median", "8",
                     "--output-median", "3", "--prompt-max", "12", "--output-max", "4", "--repeats", "1", "--warmup", "0",
                     "--device", "cpu", "--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--profile-steps", "0",
                     "--threads", "1", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "bench_lognormal_offline.json").read_text())
    assert res["runs"][0]["reps"][0]["summary"]["output_tokens"] == res["num_output_tokens_requested"]
    assert res["engine_kwargs"]["num_threads"] == 1 and '"num_threads": 1' in json.dumps(res["runs"][0]["reps"][0]["engine_config"])


# --- the command's failures, partial results and help (issue 26) ---------------------------------------------------

TINY_RUN = ["--num-requests", "2", "--prompt-median", "8", "--output-median", "3", "--prompt-max", "12",
            "--output-max", "4", "--warmup", "0", "--device", "cpu", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "64", "--profile-steps", "0"]


def fake_rep(job) -> dict:
    "What a worker returns for `job`, made up at once: every request got its tokens in 0.1 s."
    per = [{"num_output_tokens": n, "ttft_s": 0.01, "e2e_s": 0.1, "send_s": 0.0} for _, n in job["requests"]]
    return {"per_request": per, "wall_s": 0.1, "summary": summarize(per, 0.1)}


def test_cli_failing_engine_prints_the_worker_s_reason_and_exits_nonzero(model_dir, tmp_path, capsys):
    """A worker that fails (static:32 asks for more sequences than the token budget) must be reported with the
    exception's type and message, which the worker itself raised, and the command must exit non-zero. It printed
    an empty reason ('worker for static:32 failed (exit 1):') and exited 0."""
    out = tmp_path / "res.json"
    rc = bench.main(TINY_RUN[:-4] + ["--max-num-batched-tokens", "16", "--profile-steps", "0", "--engines",
                                     "continuous,static:32", "--repeats", "1", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 1, rc
    failed = [l for l in cap.out.splitlines() if "FAILED" in l]
    assert len(failed) == 1 and "static:32" in failed[0], cap.out
    assert "ValueError" in failed[0] and "max_num_batched_tokens (16)" in failed[0], failed[0]
    assert "static:32" in cap.err and "ValueError" in cap.err and "max_num_batched_tokens (16)" in cap.err
    res = json.loads(out.read_text())
    assert res["complete"] is True and [("error" in r) for r in res["runs"]] == [False, True]
    assert "ValueError" in res["runs"][1]["error"] and "File \"" in res["runs"][1]["error"]   # its traceback


def test_cli_without_out_writes_nothing(model_dir, tmp_path, capsys, monkeypatch):
    "With no --out the table is printed and no file is written: it wrote into the project's figures/data/."
    (tmp_path / "settings.ini").write_text("[DEFAULT]\n")          # a project folder, as _root() finds one
    (tmp_path / "figures" / "data").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "_spawn", lambda job, timeout: fake_rep(job))
    repo_data = Path(__file__).resolve().parents[1] / "figures" / "data"
    before = {p.name: p.stat().st_mtime_ns for p in repo_data.iterdir()} if repo_data.is_dir() else {}
    assert bench.main(["--model", str(model_dir), "--engines", "continuous", *TINY_RUN]) == 0
    out = capsys.readouterr().out
    assert "continuous" in out and "output tokens" in out and "not written" in out
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["figures", "figures/data", "settings.ini"]
    assert ({p.name: p.stat().st_mtime_ns for p in repo_data.iterdir()} if repo_data.is_dir() else {}) == before
    assert bench.main(["--model", str(model_dir), "--engines", "continuous", "--plot", *TINY_RUN]) == 2   # no folder to plot into
    assert "--plot needs --out" in capsys.readouterr().err


@pytest.mark.parametrize("interrupt_at", [(1, 0), (0, 1)])    # (engine, repeat) the Ctrl-C comes in
def test_cli_interrupted_run_keeps_what_finished(model_dir, tmp_path, capsys, monkeypatch, interrupt_at):
    "Results are written after every repeat: a run interrupted in the second engine (or repeat) keeps the first."
    calls = []
    def spawn(job, timeout):
        calls.append(job["engine"])
        engine, rep = ["continuous", "static:2"].index(job["engine"]), calls.count(job["engine"]) - 1
        if (engine, rep) == interrupt_at: raise KeyboardInterrupt
        return fake_rep(job)
    monkeypatch.setattr(bench, "_spawn", spawn)
    out = tmp_path / "res.json"
    rc = bench.main(["--model", str(model_dir), "--engines", "continuous,static:2", "--repeats", "2", *TINY_RUN,
                     "--out", str(out)])
    assert rc == 130
    res = json.loads(out.read_text())
    assert res["complete"] is False
    if interrupt_at == (1, 0):
        (run,) = res["runs"]
        assert run["engine"] == "continuous" and len(run["reps"]) == 2 and not run.get("partial")
    else:
        (run,) = res["runs"]
        assert run["engine"] == "continuous" and len(run["reps"]) == 1 and run["partial"] is True
    assert str(out) in capsys.readouterr().err


def test_cli_second_engine_failing_keeps_the_first(model_dir, tmp_path, monkeypatch):
    "A failing engine is an entry of its own; the file is complete, the exit status 1."
    def spawn(job, timeout):
        if job["engine"] == "static:2": raise RuntimeError("worker for static:2 failed (exit 1): OSError: disk full")
        return fake_rep(job)
    monkeypatch.setattr(bench, "_spawn", spawn)
    out = tmp_path / "res.json"
    assert bench.main(["--model", str(model_dir), "--engines", "continuous,static:2", *TINY_RUN, "--out", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["complete"] is True and len(res["runs"][0]["reps"]) == 2 and "disk full" in res["runs"][1]["error"]


def test_report_has_no_nan_for_one_repeat():
    per = [{"num_output_tokens": 3, "ttft_s": 0.01, "e2e_s": 0.1, "send_s": 0.0}]
    run = bench._run_entry("offline", None, "continuous", [{"per_request": per, "summary": summarize(per, 0.1)}])
    line = bench._report_line(run)
    assert "nan" not in line.lower() and "30" in line


def parser_problems(p) -> list[str]:
    "Options of `p` with no help text, and '(default: None)' noise in its help."
    import argparse
    bad = [a.option_strings[0] for a in p._actions
           if a.option_strings and not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    return bad + (["(default: None)"] if "(default: None)" in p.format_help() else []) \
        + (["(default: False)"] if "(default: False)" in p.format_help() else [])


def test_help_has_help_for_every_option_and_no_default_none():
    assert parser_problems(bench.build_parser()) == []
    from nanoserve.endpoint import build_endpoint_parser
    assert parser_problems(build_endpoint_parser()) == []


def test_cli_generate_and_simulate_help():
    import argparse
    from nanoserve.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "simulate"):
        assert parser_problems(sub.choices[name]) == [], name


def test_generate_on_cuda_without_cuda_is_one_clear_line(monkeypatch, capsys):
    "`nanoserve generate --device cuda` with no CUDA: exit 2 and one line, no traceback, before any model loads."
    import torch
    from nanoserve import cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["generate", "hello", "--device", "cuda", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoserve generate: error:") and "CUDA" in err, err
    assert "Traceback" not in err


def test_bench_on_cuda_without_cuda_is_an_error(monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "_spawn", lambda *a, **k: pytest.fail("no worker may start"))
    assert bench.main(["--device", "cuda", "--warmup", "0"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_threads_reach_the_engine(monkeypatch):
    "`--threads N` is the engine's num_threads (bench's engine keywords; generate's LLM); absent: the engine's default."
    args = bench.build_parser().parse_args(["--threads", "3"])
    assert bench.engine_kwargs_from_args(args)["num_threads"] == 3
    assert "num_threads" not in bench.engine_kwargs_from_args(bench.build_parser().parse_args([]))
    with pytest.raises(ValueError, match="--threads"):
        bench.check_args(bench.build_parser().parse_args(["--threads", "0"]))
    import nanoserve.engine
    from nanoserve import cli
    seen = []
    monkeypatch.setattr(nanoserve.engine, "LLM", lambda *a, **k: seen.append(k) or "llm")
    gen = cli.build_parser().parse_args(["generate", "x", "--threads", "2", "--device", "cpu"])
    assert cli.generate_engine(gen)[0] == "llm" and seen[-1]["num_threads"] == 2
    cli.generate_engine(cli.build_parser().parse_args(["generate", "x", "--device", "cpu"]))
    assert seen[-1].get("num_threads") is None

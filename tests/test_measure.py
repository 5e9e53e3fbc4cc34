"""The measurement rules (nanoserve.measure): warm before measuring, count device kernels only, numerator and
denominator from one run, time twice and flag disagreement over 15%; and the roofline arithmetic."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoserve.measure import (DeviceIntervals, Window, busy_share, busy_share_of, clock_ramp, count_device_kernels,
                               covered_us, decode_floor_ms, device_sync, kernels_per_step, kv_bytes_per_token,
                               merge_intervals, model_params, model_weight_bytes, profile_run, roofline_report,
                               run_from_events, span_busy_share, summarize_ramp, time_twice, warm_gpu, WINDOW_PREFIX)

ROOT = Path(__file__).resolve().parents[1]
QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)


class FakeClock:
    def __init__(self): self.t = 0.0
    def __call__(self): return self.t
    def advance(self, s): self.t += s


def ev(name, device_type, start_us, end_us, **kw):
    return dict(name=name, device_type=device_type, start_us=start_us, end_us=end_us, **kw)


# one 1,000 us step: host operators (two nested), their kernels, one host-to-device copy
STEP = [ev("aten::linear", "cpu", 0, 400), ev("aten::addmm", "cpu", 20, 390), ev("aten::silu", "cpu", 400, 480),
        ev("aten::mul", "cpu", 480, 560), ev("aten::mm", "cpu", 560, 640),
        ev("Memcpy HtoD (Pinned -> Device)", "cuda", 0, 10),
        ev("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "cuda", 100, 420),
        ev("vectorized_elementwise_kernel<silu>", "cuda", 420, 440),
        ev("vectorized_elementwise_kernel<mul>", "cuda", 440, 460),
        ev("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "cuda", 640, 920)]


# --- lie 1: the clock ramp -------------------------------------------------------------------------------------

def test_warm_gpu_is_a_no_op_on_the_cpu():
    assert warm_gpu(5.0, "cpu") == 0
    assert device_sync("cpu")() is None


def test_clock_ramp_records_a_ramp_and_its_settling():
    clk = FakeClock()
    fn = lambda: clk.advance(1e-3 * (1 + 2 * max(0.0, 1 - clk.t / 0.5)))    # 3 ms cold, 1 ms from 0.5 s
    samples = clock_ramp(fn, 2.0, sync=lambda: None, clock=clk)
    assert samples[0] == (0.0, pytest.approx(3.0))
    assert all(t < 2.0 for t, _ in samples)
    s = summarize_ramp(samples)
    assert s["first_over_warm"] == pytest.approx(3.0) and 0.4 < s["settle_s"] < 0.5


def test_summarize_ramp_ignores_one_stray_sample():
    flat = [(i / 10, 1.5 if i == 4 else 1.0) for i in range(10)]
    assert summarize_ramp(flat)["settle_s"] == 0
    assert summarize_ramp([(0, 1.0), (0.1, 2.0), (0.2, 2.0)], warm_ms=1.0)["settle_s"] is None


# --- lie 2: double-counted kernels ------------------------------------------------------------------------------

def test_count_device_kernels_counts_kernels_not_ops():
    naive = sum(e["end_us"] - e["start_us"] for e in STEP) / 1000
    assert naive == pytest.approx(1.66)                             # the 166% busy of summing every event
    assert count_device_kernels(STEP) == 4
    assert count_device_kernels(STEP, include_memory=True) == 5
    assert kernels_per_step(STEP * 4, num_steps=4) == 4
    with pytest.raises(ValueError, match="num_steps"): kernels_per_step(STEP, 0)


def test_annotations_and_copies_on_the_device_are_not_kernels():
    assert count_device_kernels([ev("range", "cuda", 0, 9, is_user_annotation=True)]) == 0      # torch 2.11 form
    assert count_device_kernels([ev("range", "cuda", 0, 9, activity_type="gpu_user_annotation")]) == 0
    assert count_device_kernels([ev("Memset (Device)", "cuda", 0, 1, activity_type="gpu_memset")]) == 0
    assert count_device_kernels([ev("my_kernel", "CUDA", 0, 1, activity_type="kernel")]) == 1


# --- lie 3: numerator and denominator from one run --------------------------------------------------------------

def test_overlapping_intervals_are_merged():
    streams = [(0, 600), (300, 900), (950, 960)]
    assert sum(e - s for s, e in streams) / 1000 > 1                 # a naive sum: more than 100% busy
    assert merge_intervals(streams) == [(0, 900), (950, 960)]
    assert covered_us(streams) == 910
    assert busy_share_of(DeviceIntervals("a", tuple(streams)), Window("a", 0, 1000)) == pytest.approx(0.91)


def test_busy_share_refuses_mismatched_runs():
    w = Window("run-a", 0, 1000)
    with pytest.raises(ValueError, match="same run"):
        busy_share_of(DeviceIntervals("run-b", ((0, 10),)), w)
    with pytest.raises(ValueError, match="outside the window"):
        busy_share_of(DeviceIntervals("run-a", ((900, 1500),)), w)
    with pytest.raises(ValueError, match="ends before it starts"):
        busy_share_of(DeviceIntervals("run-a", ((50, 40),)), w)
    assert busy_share_of(DeviceIntervals("run-a", ((900, 1003),)), w, slack_us=5) == pytest.approx(0.1)


def test_run_from_events_takes_window_and_kernels_from_one_profile():
    events = [ev(WINDOW_PREFIX + "r1", "cpu", 0, 1000),
              ev(WINDOW_PREFIX + "r1", "cuda", 100, 920, activity_type="gpu_user_annotation")] + STEP
    run = run_from_events(events, "r1", "cuda")
    assert run.num_kernels == 4 and busy_share(run) == pytest.approx(0.64)
    with pytest.raises(ValueError, match="one window range"): run_from_events(events, "r2")


def test_profile_run_on_the_cpu():
    x = torch.randn(32, 32)
    with profile_run("cpu") as run:
        for _ in range(3): x = torch.tanh(x @ x)
    with profile_run("cpu") as other:
        torch.tanh(x)
    assert run.window.duration_us > 0 and run.wall_s > 0
    assert run.num_kernels == 0 and run.busy_share == 0.0 and count_device_kernels(run.events) == 0
    assert any(e.name == "aten::mm" for e in run.events)
    with pytest.raises(ValueError, match="same run"): busy_share_of(run.kernels, other.window)


# --- lie 4: noise ------------------------------------------------------------------------------------------------

def two_speed(clk, first_ms, second_ms, repeats):
    calls = [0]
    def fn():
        clk.advance(1e-3 * (first_ms if calls[0] < repeats else second_ms)); calls[0] += 1
    return fn


@pytest.mark.parametrize("second_ms,flagged", [(12.0, True), (10.5, False), (8.0, True), (9.6, False)])
def test_time_twice_flags_disagreement_over_15_percent(second_ms, flagged):
    clk = FakeClock()
    t = time_twice(two_speed(clk, 10.0, second_ms, 20), warmup_s=0, repeats=20, sync=lambda: None, clock=clk)
    assert t.first_ms == pytest.approx(10.0) and t.second_ms == pytest.approx(second_ms)
    assert t.disagree is flagged and t.threshold == 0.15


def test_time_twice_warms_up_before_each_timing():
    clk, calls = FakeClock(), [0]
    def fn(): calls[0] += 1; clk.advance(1e-3)
    time_twice(fn, warmup_s=0.01, repeats=5, sync=lambda: None, clock=clk)
    assert calls[0] == 2 * (10 + 5)
    with pytest.raises(ValueError, match="repeats"): time_twice(fn, repeats=0)


# --- the roofline ------------------------------------------------------------------------------------------------

def test_weight_bytes_of_the_qwen25_shapes():
    assert model_params(QWEN25_05B) == 494_032_768                 # 494M, tied embeddings
    assert model_weight_bytes(QWEN25_05B) / 2**20 == pytest.approx(943, abs=1)
    assert 7.5e9 < model_params(QWEN25_7B) < 7.7e9                   # 7.6B, untied LM head
    assert kv_bytes_per_token(QWEN25_05B) == 12 * 1024
    from nanoserve.model import ModelConfig
    assert model_params(ModelConfig(max_position_embeddings=128, **QWEN25_05B)) == 494_032_768


def test_decode_floor_and_roofline_report():
    assert decode_floor_ms(model_weight_bytes(QWEN25_05B), 0, 4240) == pytest.approx(0.233, abs=0.005)
    assert decode_floor_ms(model_weight_bytes(QWEN25_7B), 0, 4240) == pytest.approx(3.6, abs=0.1)
    r = roofline_report(2.0, 0.5, busy_share=0.25)
    assert r.above_floor_share == pytest.approx(0.75) and r.idle_share == pytest.approx(0.75)
    with pytest.raises(ValueError, match="not in"): roofline_report(10, 1, busy_share=1.66)
    with pytest.raises(ValueError, match="below the floor"): roofline_report(0.1, 0.23, busy_share=0.5)


def test_import_needs_no_dev_tools_and_leaves_the_gpu_alone():
    code = ("import sys, json, torch, nanoserve.measure\n"
            "print(json.dumps({'dev': sorted(m for m in sys.modules if m.split('.')[0] in ('fastcore', 'nbdev')),"
            " 'cuda_init': torch.cuda.is_initialized()}))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"dev": [], "cuda_init": False}


def test_span_busy_share_counts_covered_window_once():
    class Ev:                                         # a recorded event at t milliseconds
        def __init__(self, t): self.t = t
        def elapsed_time(self, other): return other.t - self.t
    steps = [(Ev(0.0), Ev(1.0)), (Ev(1.5), Ev(2.0)), (Ev(1.6), Ev(1.8))]   # a 0.5 ms wait; one span inside another
    assert abs(span_busy_share(steps) - 1.5 / 2.0) < 1e-12
    assert span_busy_share([(Ev(3.0), Ev(4.0))]) == 1.0
    with pytest.raises(ValueError, match="no spans"): span_busy_share([])
    with pytest.raises(ValueError, match="ends before"): span_busy_share([(Ev(1.0), Ev(0.0))])

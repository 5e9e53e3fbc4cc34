#!/usr/bin/env bash
# The benchmark issue's measurements on the H200, in one device call (about 8 minutes).
# Run on the device machine from the repo root:  NANOSERVE_GIT_SHA=<sha> bash kernels/bench_h200.sh
# Writes into $OUT (or figures/data): clock_ramp_h200.json, bench_lognormal_offline.json,
# bench_lognormal_poisson.json and bench_h200.log; copy the JSON files to figures/data/.
#
# Random weights of the Qwen2.5-0.5B shape in bf16. Same requests for every engine, each engine twice, each run
# in a fresh process. Concurrency is capped the same for every engine: --max-num-seqs 32, static batch 32.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 NANOSERVE_CACHE=${NANOSERVE_CACHE:-/tmp/nscache}
OUT=${OUT:-figures/data}
LOG=$OUT/bench_h200.log
COMMON="--shape 0.5B --workload lognormal --prompt-median 256 --output-median 128 --prompt-max 1024 --output-max 512
        --max-num-seqs 32 --max-num-batched-tokens 2048 --num-kv-blocks 8192 --dtype bfloat16"
{
  python kernels/clock_ramp_h200.py --out "$OUT"
  python -m nanoserve.bench $COMMON --num-requests 128 --engines continuous,static:32,hf-cb \
         --out "$OUT/bench_lognormal_offline.json"
  python -m nanoserve.bench $COMMON --num-requests 64 --rate 4 --engines continuous,static:32 \
         --out "$OUT/bench_lognormal_poisson.json"
} 2>&1 | grep -v -E "USDT|Loading weights|profiler_st" | tee "$LOG"

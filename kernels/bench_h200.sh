#!/usr/bin/env bash
# The benchmark issue's measurements on the H200. One part per device call (each fits the 10-minute limit):
#   NANOSERVE_GIT_SHA=<sha> bash kernels/bench_h200.sh ramp       clock ramp (~30 s)
#   NANOSERVE_GIT_SHA=<sha> bash kernels/bench_h200.sh offline    continuous, static:32 (CUDA graphs), hf-cb; twice each
#   NANOSERVE_GIT_SHA=<sha> bash kernels/bench_h200.sh offline-eager   the same two nanoserve engines with graphs off
# (2026-11-29, second session: six engines in one part ran past 580 s and wrote no JSON; the bench writes its
# JSON only at the end, so keep each part well inside the limit.)
#   NANOSERVE_GIT_SHA=<sha> bash kernels/bench_h200.sh poisson    continuous and static:32 under Poisson load (~4 min)
# Writes into $OUT (or figures/data): clock_ramp_h200.json, bench_lognormal_offline.json,
# bench_lognormal_poisson.json and bench_h200_<part>.log; copy the JSON files to figures/data/.
# (2026-11-29: "ramp" + "offline" together ran past the 590 s limit before "poisson" started.)
#
# Random weights of the Qwen2.5-0.5B shape in bf16. Same requests for every engine, each engine twice, each run
# in a fresh process. Concurrency is capped the same for every engine: --max-num-seqs 32, static batch 32.
set -u
part=${1:-offline}
export PYTHONPATH=. PYTHONUNBUFFERED=1 NANOSERVE_CACHE=${NANOSERVE_CACHE:-/tmp/nscache}
OUT=${OUT:-figures/data}
COMMON="--shape 0.5B --workload lognormal --prompt-median 256 --output-median 128 --prompt-max 1024 --output-max 512
        --max-num-seqs 32 --max-num-batched-tokens 2048 --num-kv-blocks 8192 --dtype bfloat16"
case $part in
  ramp)    cmd="python kernels/clock_ramp_h200.py --out $OUT" ;;
  offline) cmd="python -m nanoserve.bench $COMMON --num-requests 128 --engines continuous,static:32,hf-cb --out $OUT/bench_lognormal_offline.json" ;;
  offline-eager) cmd="python -m nanoserve.bench $COMMON --num-requests 128 --engines continuous-eager,static-eager:32 --out $OUT/bench_lognormal_offline_eager.json" ;;
  poisson) cmd="python -m nanoserve.bench $COMMON --num-requests 64 --rate 4 --engines continuous,static:32 --out $OUT/bench_lognormal_poisson.json" ;;
  *) echo "usage: $0 ramp|offline|offline-eager|poisson" >&2; exit 2 ;;
esac
$cmd 2>&1 | grep -v -E "USDT|Loading weights|profiler_st" | tee "$OUT/bench_h200_$part.log"

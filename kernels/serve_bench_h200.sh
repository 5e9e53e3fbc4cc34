#!/usr/bin/env bash
# The benchmark and server issues' measurements with CUDA graphs on, in one device call (~8 min):
#   NANOSERVE_GIT_SHA=<sha> bash kernels/serve_bench_h200.sh
# 1. (only with OFFLINE=1) offline, 128 lognormal requests: continuous vs static:32 vs transformers' CB (hf-cb);
# 2. Poisson arrivals at RATE req/s, 128 requests: continuous vs static:32, the same send times;
# 3. the same Poisson load through `nanoserve serve` over HTTP (bench --endpoint): the server's overhead
#    against the engine driven directly in step 2.
# Every engine twice, each run in a fresh process; the server is started once. Random weights of the
# Qwen2.5-0.5B shape in bf16; concurrency capped the same for every engine (32).
# (2026-11-29: the HTTP part ran past 120 s unwarmed; it now warms the server first and allows 200 s.)
# Needs fastapi/uvicorn there: carry .whl (see the device tool's README) and run with WHEELS=1.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NANOSERVE_CACHE=${NANOSERVE_CACHE:-/tmp/nscache}
OUT=${OUT:-figures/data}
RATE=${RATE:-12}
COMMON="--workload lognormal --prompt-median 256 --output-median 128 --prompt-max 1024 --output-max 512 --num-requests 128"
ENGINE="--max-num-seqs 32 --max-num-batched-tokens 2048 --num-kv-blocks 8192 --dtype bfloat16"
filter() { grep --line-buffered -v -E "USDT|Loading weights|profiler_st"; }
MODEL=$(python -c "from nanoserve.bench import random_checkpoint; print(random_checkpoint('0.5B'))")
echo "model: $MODEL"
if [ "${OFFLINE:-0}" = 1 ]; then     # ran past 260 s with hf-cb on 2026-11-29: use bench_h200.sh offline instead
timeout 260 python -m nanoserve.bench --model $MODEL $COMMON $ENGINE --engines continuous,static:32,hf-cb \
  --out $OUT/bench_lognormal_offline.json 2>&1 | filter
fi
timeout 170 python -m nanoserve.bench --model $MODEL $COMMON $ENGINE --rate $RATE --engines ${ENGINES:-continuous,static:32} --profile-steps ${PROFILE_STEPS:-0} \
  --out $OUT/bench_lognormal_poisson.json 2>&1 | filter
python -m nanoserve.server --model $MODEL --port 8765 --served-model-name qwen-0.5b-random $ENGINE --no-access-log \
  --log-level warning > $OUT/serve_h200.log 2>&1 &
SERVER=$!
python - <<'PY'
import time, urllib.request
for _ in range(240):
    try: urllib.request.urlopen("http://127.0.0.1:8765/health", timeout=1); break
    except Exception: time.sleep(0.5)
PY
# warm the server (Triton compiles, first-touch allocations) with 32 requests at the workload's lengths, unmeasured
timeout 150 python -m nanoserve.endpoint --endpoint http://127.0.0.1:8765 --served-model qwen-0.5b-random $COMMON \
  --num-requests 32 --repeats 1 --vocab-size 151936 --max-model-len 32768 --out /tmp/warm_http.json 2>&1 | filter
timeout 200 python -m nanoserve.endpoint --endpoint http://127.0.0.1:8765 --served-model qwen-0.5b-random $COMMON --rate $RATE \
  --vocab-size 151936 --max-model-len 32768 --out $OUT/bench_lognormal_poisson_http.json 2>&1 | filter
kill -INT $SERVER; wait $SERVER

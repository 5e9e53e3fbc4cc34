#!/usr/bin/env bash
# The benchmark and server issues' measurements with CUDA graphs on, in one device call (~8 min):
#   NANOSERVE_GIT_SHA=<sha> bash kernels/serve_bench_h200.sh
# 1. (only with OFFLINE=1) offline, 128 lognormal requests: continuous vs static:32 vs transformers' CB (hf-cb);
# 2. Poisson arrivals at RATE req/s, 128 requests: continuous vs static:32, the same send times;
# 3. the same Poisson load through `nanoserve serve` over HTTP (bench --endpoint): the server's overhead
#    against the engine driven directly in step 2.
# Every engine twice, each run in a fresh process; the server is started once. Random weights of the
# Qwen2.5-0.5B shape in bf16; concurrency capped the same for every engine (32).
# The HTTP part runs past 120 s unwarmed: the server is warmed first, and the part allowed 200 s.
# Needs fastapi/uvicorn there: carry .whl (see the device tool's README) and run with WHEELS=1.
#
#   bash kernels/serve_bench_h200.sh --smoke
# the same three steps as a tiny CPU version: the built-in tiny model in fp32 under the Triton interpreter, a few
# short requests, each engine once, the server on a free local port, the output in a temporary folder
# ($NANOSERVE_SMOKE_OUT if set). $PYTHON names the interpreter (default: python).
set -u -o pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
filter() { grep --line-buffered -v -E "USDT|Loading weights|profiler_st" || true; }
if [ "${1:-}" = --smoke ]; then
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  OUT=${NANOSERVE_SMOKE_OUT:-$(mktemp -d -t nanoserve-smoke-XXXXXX)}
  RATE=20; OFFLINE=1
  COMMON="--workload lognormal --prompt-median 16 --output-median 4 --prompt-max 32 --output-max 8 --num-requests 6"
  ENGINE="--max-num-seqs 4 --max-num-batched-tokens 256 --num-kv-blocks 256 --dtype float32"
  RUNS="--repeats 1 --warmup 0"; STATIC=static:4; WARM_N=4; WARM_OUT=$OUT/warm_http.json
  MODEL=$($PY -c "from nanoserve.tokenizer import ensure_default_model; print(ensure_default_model())") || exit 1
  LIMITS=$($PY -c "import json,sys; c=json.load(open(sys.argv[1]+'/config.json')); print(c['vocab_size'], c['max_position_embeddings'])" "$MODEL") || exit 1
  PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
else
  export NANOSERVE_CACHE=${NANOSERVE_CACHE:-/tmp/nscache}
  OUT=${OUT:-figures/data}
  RATE=${RATE:-12}; OFFLINE=${OFFLINE:-0}
  COMMON="--workload lognormal --prompt-median 256 --output-median 128 --prompt-max 1024 --output-max 512 --num-requests 128"
  ENGINE="--max-num-seqs 32 --max-num-batched-tokens 2048 --num-kv-blocks 8192 --dtype bfloat16"
  RUNS=""; STATIC=static:32; WARM_N=32; WARM_OUT=/tmp/warm_http.json
  MODEL=$($PY -c "from nanoserve.bench import random_checkpoint; print(random_checkpoint('0.5B'))") || exit 1
  LIMITS="151936 32768"; PORT=8765
fi
read -r VOCAB MAXLEN <<< "$LIMITS"
mkdir -p "$OUT"
echo "model: $MODEL"
if [ "$OFFLINE" = 1 ]; then     # with hf-cb it runs past 260 s on the H200: bench_h200.sh offline does it alone
  timeout 260 $PY -m nanoserve.bench --model $MODEL $COMMON $ENGINE $RUNS --engines continuous,$STATIC,hf-cb \
    --out $OUT/bench_lognormal_offline.json 2>&1 | filter || exit $?
fi
timeout 170 $PY -m nanoserve.bench --model $MODEL $COMMON $ENGINE $RUNS --rate $RATE --engines ${ENGINES:-continuous,$STATIC} \
  --profile-steps ${PROFILE_STEPS:-0} --out $OUT/bench_lognormal_poisson.json 2>&1 | filter || exit $?
$PY -m nanoserve.server --model $MODEL --port $PORT --served-model-name qwen-0.5b-random $ENGINE --no-access-log \
  --log-level warning > $OUT/serve_h200.log 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
$PY - "$PORT" <<'PY' || exit 1
import sys, time, urllib.request
for _ in range(240):
    try: urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1); break
    except Exception: time.sleep(0.5)
else: sys.exit("the server did not come up")
PY
# warm the server (Triton compiles, first-touch allocations) with requests at the workload's lengths, unmeasured
timeout 150 $PY -m nanoserve.endpoint --endpoint http://127.0.0.1:$PORT --served-model qwen-0.5b-random $COMMON $RUNS \
  --num-requests $WARM_N --repeats 1 --vocab-size $VOCAB --max-model-len $MAXLEN --out $WARM_OUT 2>&1 | filter || exit $?
timeout 200 $PY -m nanoserve.endpoint --endpoint http://127.0.0.1:$PORT --served-model qwen-0.5b-random $COMMON $RUNS --rate $RATE \
  --vocab-size $VOCAB --max-model-len $MAXLEN --out $OUT/bench_lognormal_poisson_http.json 2>&1 | filter || exit $?
if [ "${1:-}" = --smoke ]; then                # a failed engine is recorded, not fatal, in the bench: here it is
  $PY - "$OUT" <<'PY' || exit 1
import json, pathlib, sys
bad = [(p.name, r["engine"]) for p in pathlib.Path(sys.argv[1]).glob("bench_*.json")
       for r in json.loads(p.read_text())["runs"] if "error" in r]
if bad: sys.exit(f"failed engines: {bad}")
PY
fi

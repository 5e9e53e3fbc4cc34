#!/usr/bin/env bash
# The benchmark issue's measurements on the H200. One part per device call (each fits the 10-minute limit):
#   NANOSERVE_GIT_SHA=<sha> bash kernels/bench_h200.sh ramp       clock ramp (~30 s)
#   NANOSERVE_GIT_SHA=<sha> bash kernels/bench_h200.sh offline    continuous, static:32 (CUDA graphs), hf-cb; twice each
#   NANOSERVE_GIT_SHA=<sha> bash kernels/bench_h200.sh offline-eager   the same two nanoserve engines with graphs off
#   NANOSERVE_GIT_SHA=<sha> bash kernels/bench_h200.sh poisson    continuous and static:32 under Poisson load (~4 min)
# Six engines in one part run past the 10-minute limit, and the bench writes its JSON only at the end: keep each
# part well inside the limit ("ramp" and "offline" together already come close).
# Writes into $OUT (or figures/data): clock_ramp_h200.json, bench_lognormal_offline.json,
# bench_lognormal_poisson.json and bench_h200_<part>.log; copy the JSON files to figures/data/.
#
# Random weights of the Qwen2.5-0.5B shape in bf16. Same requests for every engine, each engine twice, each run
# in a fresh process. Concurrency is capped the same for every engine: --max-num-seqs 32, static batch 32.
#
#   bash kernels/bench_h200.sh --smoke [PART...]
# runs every part (or the ones named) as a tiny CPU version: the built-in tiny model in fp32 under the Triton
# interpreter, a few short requests, each engine once, the output in a temporary folder ($NANOSERVE_SMOKE_OUT if set).
# $PYTHON names the interpreter (default: python).
set -u -o pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python}                          # the interpreter (tests/test_lab_smoke.py passes its own)
filter() { grep --line-buffered -v -E "USDT|Loading weights|profiler_st" || true; }
SMOKE=""
if [ "${1:-}" = --smoke ]; then
  shift; SMOKE=1
  export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  OUT=${NANOSERVE_SMOKE_OUT:-$(mktemp -d -t nanoserve-smoke-XXXXXX)}
  MODEL=""                                    # the bench's default: the built-in tiny model
  COMMON="--workload lognormal --prompt-median 16 --output-median 4 --prompt-max 32 --output-max 8
          --max-num-seqs 4 --max-num-batched-tokens 256 --num-kv-blocks 256 --dtype float32 --repeats 1 --warmup 0"
  N_OFFLINE=6; N_POISSON=4; STATIC=static:4; RAMP="--smoke"; PARTS=${*:-ramp offline offline-eager poisson}
else
  export NANOSERVE_CACHE=${NANOSERVE_CACHE:-/tmp/nscache}
  OUT=${OUT:-figures/data}
  MODEL="--shape 0.5B"
  COMMON="--workload lognormal --prompt-median 256 --output-median 128 --prompt-max 1024 --output-max 512
          --max-num-seqs 32 --max-num-batched-tokens 2048 --num-kv-blocks 8192 --dtype bfloat16"
  N_OFFLINE=128; N_POISSON=64; STATIC=static:32; RAMP="--out $OUT"; PARTS=${1:-offline}
fi
mkdir -p "$OUT"
for part in $PARTS; do
  case $part in
    ramp)    cmd="$PY kernels/clock_ramp_h200.py $RAMP" ;;
    offline) cmd="$PY -m nanoserve.bench $MODEL $COMMON --num-requests $N_OFFLINE --engines continuous,$STATIC,hf-cb --out $OUT/bench_lognormal_offline.json" ;;
    offline-eager) cmd="$PY -m nanoserve.bench $MODEL $COMMON --num-requests $N_OFFLINE --engines continuous-eager,static-eager:${STATIC#static:} --out $OUT/bench_lognormal_offline_eager.json" ;;
    poisson) cmd="$PY -m nanoserve.bench $MODEL $COMMON --num-requests $N_POISSON --rate 4 --engines continuous,$STATIC --out $OUT/bench_lognormal_poisson.json" ;;
    *) echo "usage: $0 [--smoke] ramp|offline|offline-eager|poisson" >&2; exit 2 ;;
  esac
  $cmd 2>&1 | filter | tee "$OUT/bench_h200_$part.log" || exit $?
done
if [ -n "$SMOKE" ]; then                      # the bench records a failed engine and goes on: a smoke run must not
  $PY - "$OUT" <<'PY' || exit 1
import json, pathlib, sys
bad = [(p.name, r["engine"]) for p in pathlib.Path(sys.argv[1]).glob("bench_*.json")
       for r in json.loads(p.read_text())["runs"] if "error" in r]
if bad: sys.exit(f"failed engines: {bad}")
PY
fi
echo "wrote into $OUT"

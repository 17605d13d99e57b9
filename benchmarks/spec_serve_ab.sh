#!/usr/bin/env bash
# A/B of speculative decoding on one workload: the same server without and with
# --speculative-config, one after the other (ROUNDS times, interleaved), then
# `kvserve bench serve` against each. Usage:
#   benchmarks/spec_serve_ab.sh OUTDIR WORKLOAD CONCURRENCY NUM_REQUESTS INPUT_LEN OUTPUT_LEN [ROUNDS] [SPEC_JSON]
# Servers bind 127.0.0.1 only; torch runs one thread (OMP_NUM_THREADS=1) unless set.
# SERVE_ARGS: extra args for both servers (e.g. "--quantization none" for a bf16 target);
# BENCH_ARGS: extra args for both bench runs (e.g. "--temperature 1").
set -euo pipefail
out=$1; workload=$2; conc=$3; nreq=$4; inlen=$5; outlen=$6; rounds=${7:-1}
spec=${8:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'}
py=${PYTHON:-/work/main/.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
port=${PORT:-18431}
mkdir -p "$out"
run() {  # name, extra serve args...
  local name=$1; shift
  "$py" -m kvserve.entrypoints.cli serve --host 127.0.0.1 --port "$port" --no-access-log \
      --max-model-len 2048 ${SERVE_ARGS:-} "$@" >"$out/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 1
  done
  "$py" -m kvserve.entrypoints.cli bench serve --base-url "http://127.0.0.1:$port" \
      --workload "$workload" --max-concurrency "$conc" --num-requests "$nreq" \
      --input-len "$inlen" --output-len "$outlen" --warmup 1 --no-plots ${BENCH_ARGS:-} \
      --output "$out/$name" | tee "$out/$name.txt" | grep -E "output token throughput|acceptance|TPOT|median:" | head -8
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
for r in $(seq 1 "$rounds"); do
  echo "== round $r: base"; run "base.$r"
  echo "== round $r: spec"; run "spec.$r" --speculative-config "$spec"
done

#!/usr/bin/env bash
# Where a serving process's interpreter time goes under saturate: one ./server.sh dynamic (settings from the
# environment), a warm-up run, then RUNS measured runs of saturate with N streamed requests, each under
# benchmarks/thread_cpu.py (the loop thread's CPU against the request threads'), the last also sampled by
# py-spy (if installed) for the threads holding the GIL, written raw (stack;... count) to OUT/gil-N.txt.
#
#   bash benchmarks/host_profile.sh 128 [RUNS] [OUT]                    # MODEL etc. from the environment
#   ENGINE=sim SIM_GPU=h100-sxm bash benchmarks/host_profile.sh 128     # the host path alone, no compute
set -uo pipefail
cd "$(dirname "$0")/.." || exit
n=${1:?usage: $0 REQUESTS [RUNS] [OUT]} runs=${2:-2} out=${3:-results/host-profile}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PORT=${PORT:-8531} FRONT=off
url=http://127.0.0.1:$PORT
./server.sh dynamic >"$out/server-$n.log" 2>&1 &
master=$!
trap 'kill -TERM $master 2>/dev/null; wait $master 2>/dev/null' EXIT
for _ in $(seq 600); do curl -sf "$url/health" >/dev/null && break; sleep 0.2; done
curl -sf "$url/health" >/dev/null || { echo "the server did not start:"; tail -20 "$out/server-$n.log"; exit 1; }
worker=$(pgrep -P "$master" -f gunicorn | head -1)
bench=("$PY" client/benchmark.py --workload saturate --numsamples "$n" --url "$url")
"${bench[@]}" --out "$out/warmup-$n" >/dev/null 2>&1
for run in $(seq "$runs"); do
  if [ "$run" = "$runs" ] && command -v py-spy >/dev/null; then
    py-spy record --nonblocking --gil -r 200 -f raw -d 30 -p "$worker" -o "$out/gil-$n.txt" >"$out/py-spy-$n.log" 2>&1 &
    spy=$!
    sleep 1
  fi
  "$PY" -m benchmarks.thread_cpu "$worker" -- "${bench[@]}" --out "$out/run-$n-$run" | grep -A1 "out tok/s\|^threads"
done
[ -n "${spy:-}" ] && { kill -INT $spy 2>/dev/null; wait $spy; tail -2 "$out/py-spy-$n.log"; }
exit 0

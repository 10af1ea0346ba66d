#!/usr/bin/env bash
# The GPU checks and measurements of docs/benchmarks.md, in stages that each end well inside ten minutes (one
# device command each: the sum of a stage's step limits stays under 560 s).
#
#   bash benchmarks/gpu_suite.sh wheels              # with network: what the GPU image lacks, into .whl/
#   bash benchmarks/gpu_suite.sh first-light         # one short call: the kernel's and graphs' tests, decode
#                                                    #   steps with both backends, saturate (dynamic)
#   bash benchmarks/gpu_suite.sh tuned               # one short call after tuning: the kernel's tests, decode
#                                                    #   steps, saturate with Python's GIL switch interval and
#                                                    #   0.5 ms, static and dynamic, seed-like (40), the servers'
#                                                    #   tests
#   bash benchmarks/gpu_suite.sh one-by-one          # one call: the CUDA tests (servers at a 7-token budget too),
#                                                    #   decode steps and saturate with the kernel and graphs
#                                                    #   off, the kernel alone, both; seed-like (40)
#   bash benchmarks/gpu_suite.sh base COMMIT         # here: COMMIT's tree into .base/, for host-ab (carry it too)
#   bash benchmarks/gpu_suite.sh host-ab             # one call: saturate, this tree against .base/ in turns (128
#                                                    #   requests thrice, 512 once), 512 with SWITCH_INTERVAL_MS,
#                                                    #   seed-like (40); the graphs' tests first, the benchmark's last
#   bash benchmarks/gpu_suite.sh stream-interval     # one call: the CUDA tests (kernel and model), saturate with
#                                                    #   STREAM_INTERVAL 1, 8 and 32 in turns (128 requests twice,
#                                                    #   512 once), transformers' two baselines (128)
#   bash benchmarks/gpu_suite.sh stream-interval-2   # one call: saturate (128) with STREAM_INTERVAL 16 and 32 in
#                                                    #   turns, 32 with SWITCH_INTERVAL_MS=0.5 (128, 512), seed-like
#                                                    #   (40) at 32, nobatch (128)
#   bash benchmarks/gpu_suite.sh overlap             # one call (after base): the CUDA tests (kernel, model, async
#                                                    #   scheduling), decode steps (profiled; sync; .base), saturate
#                                                    #   (128) at STREAM_INTERVAL 1 and 32 against .base in turns
#   bash benchmarks/gpu_suite.sh overlap-2           # one call: overlap's saturate again in turns, 512 requests,
#                                                    #   seed-like (40), decode steps
#   bash benchmarks/gpu_suite.sh host-profile        # one call: the CUDA tests (kernel, model, servers), decode
#                                                    #   steps at 128 and 256, where the server's interpreter time
#                                                    #   goes (benchmarks/host_profile.sh, py-spy carried in .whl),
#                                                    #   saturate at STREAM_INTERVAL 1 and 32 in turns, 512, seed-like
#   bash benchmarks/gpu_suite.sh tree-ab            # one short call (after base): decode steps and saturate at
#                                                    #   STREAM_INTERVAL=1, this tree against .base in turns
#   bash benchmarks/gpu_suite.sh engine-process      # one call (after base): the engine process's tests on the GPU,
#                                                    #   saturate with ENGINE_PROCESS off, on, and on with
#                                                    #   API_SERVER_COUNT=4 in turns (128 at STREAM_INTERVAL 1; 32;
#                                                    #   512 with 1 and 4 front ends), seed-like (20), decode steps
#                                                    #   against .base
#   bash benchmarks/gpu_suite.sh front-ends          # one call: saturate (128, STREAM_INTERVAL 1) over 1, 2 and 4
#                                                    #   front ends (API_SERVER_COUNT) in turns, 32 over 4, 512 over
#                                                    #   1 and 4, seed-like (20)
#   bash benchmarks/gpu_suite.sh kv-check            # one call: the Triton kernels' tests (quantized caches too),
#                                                    #   decode steps at batch 256 over ~1,000-token contexts with
#                                                    #   KV_CACHE_DTYPE auto, int8 and fp8, greedy against
#                                                    #   transformers through the engine's process in every mode
#   bash benchmarks/gpu_suite.sh servers             # one call: real servers at a 7-token budget, the API's tests
#   bash benchmarks/gpu_suite.sh kv-cache            # one call: the Triton kernels' tests (quantized caches: int8,
#                                                    #   fp8_e4m3, fp8_e5m2; and the float ones), decode steps at
#                                                    #   batch 256 over ~1,000-token contexts with KV_CACHE_DTYPE
#                                                    #   auto, int8 and fp8; saturate (256) with each
#   bash benchmarks/gpu_suite.sh check               # versions, the CUDA tests (kernel and model; servers)
#   bash benchmarks/gpu_suite.sh tune                # decode steps with both backends, a profiler table, the
#                                                    #   kernel's knobs swept
#   bash benchmarks/gpu_suite.sh saturate            # saturate (128): static and dynamic, then dynamic without
#                                                    #   the kernel and graphs ("before": one change)
#   bash benchmarks/gpu_suite.sh saturate-others     # saturate: nobatch, transformers' generate, its continuous
#                                                    #   batching
#   bash benchmarks/gpu_suite.sh seed-like           # seed-like (100 at 1 req/s): each mode
#   bash benchmarks/gpu_suite.sh seed-like-baselines # seed-like: both transformers baselines
#   bash benchmarks/gpu_suite.sh check tune          # stages run in the order given
#
# The device call must carry .whl (run: carry [".whl"]) on an image without flask, gunicorn,
# python-dotenv or openai: they are installed from it into /tmp/site first. Each stage writes into
# $OUT (default results/gpu) its log and one .tar.gz (results, server logs, profiler table,
# nvidia-smi after each step), and prints last a table of each step's time against its limit, GPU
# memory in use after it and whether it passed (also in $OUT/summary.txt): three files a stage,
# within the device's eight. A failing step does not stop the rest, and what a step leaves behind
# (a server past its time limit) is killed before the next.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
ROOT=$(pwd -P)

OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1  # no progress bars in the logs
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
RESULTS=results/gpu-runs  # each step's results; a stage's go into its archive
: >"$SUMMARY"

wheels() {  # the server's and the tests' packages for Python 3.12 on x86-64 Linux that the GPU image lacks
  local all=/tmp/gpu-wheels
  rm -rf .whl "$all" && mkdir .whl
  # Resolved together (so versions agree), then only those the image lacks are kept: installed --no-deps,
  # nothing shadows the image's own packages.
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$all" $(grep -v '^torch' requirements.txt | sed 's/#.*//') openai || return
  for wheel in "$all"/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    grep -qx "$name" benchmarks/gpu_image_packages.txt || cp "$wheel" .whl/
  done
  rm -rf "$all"
  ls .whl
}

install_wheels() {
  "$PY" -c "import flask, gunicorn, dotenv, openai, msgspec" 2>/dev/null && return
  ls .whl/*.whl >/dev/null 2>&1 || { echo "flask, gunicorn, python-dotenv or openai missing, and no .whl/ (carry it)" >&2; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH  # bin: py-spy, if carried
  "$PY" -c "import flask, gunicorn, dotenv, openai, msgspec" || exit 1
}

leftovers() {  # servers and balancers started from this checkout that are still running
  local pid
  for pid in $(pgrep -f 'gunicorn|haproxy|cluster.sh'); do
    [ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" = "$ROOT" ] && echo "$pid"
  done
}

kill_leftovers() {  # a step past its limit may leave a server holding the GPU: TERM its group, then KILL
  local pids pid
  pids=$(leftovers)
  [ -z "$pids" ] && return
  echo "killing what the step left: $(echo $pids)"
  for pid in $pids; do kill -TERM -- "-$(ps -o pgid= "$pid" | tr -d ' ')" "$pid" 2>/dev/null; done
  for _ in $(seq 50); do [ -z "$(leftovers)" ] && return; sleep 0.2; done
  for pid in $(leftovers); do kill -KILL -- "-$(ps -o pgid= "$pid" | tr -d ' ')" "$pid" 2>/dev/null; done
}

gpu_memory() {
  command -v nvidia-smi >/dev/null || { echo "-"; return; }
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1 | sed 's/$/ MiB/'
}

step() {  # step NAME SECONDS COMMAND...: run it under a time limit; its time against the limit into the summary
  local name=$1 limit=$2 start rc
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"  # into the archive too
  rc=${PIPESTATUS[0]}
  kill_leftovers
  { echo "=== after $name"; command -v nvidia-smi >/dev/null && nvidia-smi; } >>"$RESULTS/nvidia-smi.txt" 2>&1
  printf '%-22s %4ss of %4ss  GPU %-10s %s\n' "$name" "$(($(date +%s) - start))" "$limit" "$(gpu_memory)" \
    "$([ $rc = 0 ] && echo ok || echo "FAILED ($rc)")" | tee -a "$SUMMARY"
}

benchmark() {  # benchmark NAME SECONDS [ENV=VALUE...] -- BENCHMARK ARGS...: one benchmark step, results in $RESULTS/NAME
  local name=$1 limit=$2 settings=()
  shift 2
  while [ "$1" != -- ]; do settings+=("$1"); shift; done
  shift
  step "$name" "$limit" env MODEL="${MODEL:-random:gpt2-medium}" "${settings[@]}" "$PY" client/benchmark.py "$@" \
    --report --out "$RESULTS/$name"
}

archive() {  # archive STAGE STEP...: the steps' results (merged into one table), server logs and the rest
  local stage=$1 dirs=()
  shift
  for name in "$@"; do [ -f "$RESULTS/$name/results.json" ] && dirs+=("$RESULTS/$name"); done
  [ ${#dirs[@]} -gt 0 ] && "$PY" client/benchmark.py --rebuild "${dirs[@]}" --report --out "$RESULTS/$stage"
  tar czf "$OUT/$stage.tar.gz" -C "$RESULTS" .
}

check() {
  step nvidia-smi 20 nvidia-smi
  step versions 60 "$PY" -c "import sys, torch, triton, transformers as t; print(sys.version, 'torch', torch.__version__,
torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__, 'transformers', t.__version__)"
  # Greedy output against transformers through the kernel and graph capture, in float32 and in half
  # precision; then every mode and the API through real servers (kernel and graphs, in float32). The
  # first run compiles the kernel's variants (Triton's cache is cold) and captures graphs at each start.
  step cuda-kernel-model 200 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_half_precision.py tests/test_model.py tests/test_forks.py \
    tests/test_prefix_cache.py tests/test_chunked_prefill.py tests/test_prompt_logprobs.py
  step cuda-servers 300 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider \
    tests/test_server.py tests/test_openai.py tests/test_benchmark_safety.py
  archive check
}

first_light() {  # the least that shows the kernel and graphs right and their speed: ~6 minutes at most
  step versions 30 "$PY" -c "import sys, torch, triton, transformers as t; print(sys.version, 'torch', torch.__version__,
torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__, 'transformers', t.__version__)"
  step cuda-kernel-model 130 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_half_precision.py tests/test_model.py tests/test_forks.py \
    tests/test_prefix_cache.py tests/test_chunked_prefill.py tests/test_prompt_logprobs.py
  local decode=("$PY" -m benchmarks.decode_step --batch-sizes 1,32,128,256 --context 200 --steps 20)
  step decode-triton 60 "${decode[@]}"
  step decode-reference 45 env ATTENTION_BACKEND=reference CUDA_GRAPHS=off "${decode[@]}"
  benchmark saturate-dynamic 90 -- --workload saturate --numsamples 256 --modes dynamic
  archive first-light saturate-dynamic
}

tuned() {  # ~6.5 minutes at most
  step cuda-kernel 70 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_triton_attention.py \
    tests/test_half_precision.py tests/test_forks.py tests/test_prompt_logprobs.py
  step decode-triton 40 "$PY" -m benchmarks.decode_step --batch-sizes 1,32,128,256 --context 200 --steps 20 --profile
  local saturate=(--workload saturate --numsamples 512 --modes dynamic)
  benchmark saturate-512 45 -- "${saturate[@]}"
  benchmark saturate-512-switch 45 SWITCH_INTERVAL_MS=0.5 -- "${saturate[@]}"
  benchmark saturate-batched 40 -- --workload saturate --numsamples 128 --modes static,dynamic
  benchmark seed-like-dynamic 65 -- --workload seed-like --numsamples 40 --modes dynamic
  step cuda-servers 90 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_server.py \
    tests/test_openai.py
  archive tuned saturate-512 saturate-512-switch saturate-batched seed-like-dynamic
}

one_by_one() {  # ~9 minutes at most: correctness first, then each change's effect alone
  step versions 20 "$PY" -c "import sys, torch, triton, transformers as t; print(sys.version, 'torch', torch.__version__,
torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__, 'transformers', t.__version__)"
  step cuda-kernel-model 90 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_half_precision.py tests/test_model.py tests/test_forks.py \
    tests/test_prefix_cache.py tests/test_chunked_prefill.py tests/test_prompt_logprobs.py
  # every mode through real servers with a 7-token step budget: prompts in chunks, decodes from graphs
  step cuda-servers-budget-7 150 env DTYPE=float32 MAX_BATCH_TOKENS=7 "$PY" -m pytest -q -ra -p no:cacheprovider \
    tests/test_server.py -k "transformers or alone or stopped or missing_baseline" tests/test_benchmark_safety.py
  local decode=("$PY" -m benchmarks.decode_step --batch-sizes 1,32,128,256 --context 200 --steps 20)
  step decode-both 30 "${decode[@]}" --profile
  step decode-kernel 30 env CUDA_GRAPHS=off "${decode[@]}"
  step decode-neither 30 env ATTENTION_BACKEND=reference CUDA_GRAPHS=off "${decode[@]}"
  local common=(--workload saturate --numsamples 128 --modes dynamic)
  benchmark saturate-both 60 -- --workload saturate --numsamples 128 --modes static,dynamic
  benchmark saturate-kernel 35 CUDA_GRAPHS=off -- "${common[@]}"
  benchmark saturate-neither 45 ATTENTION_BACKEND=reference CUDA_GRAPHS=off -- "${common[@]}"
  benchmark seed-like-dynamic 65 -- --workload seed-like --numsamples 40 --modes dynamic
  archive one-by-one saturate-both saturate-kernel saturate-neither seed-like-dynamic
}

host_ab() {  # ~7.5 minutes at most: a change to the server's host side against the tree before it, in turns
  [ -f .base/client/benchmark.py ] || { echo "no .base/: bash benchmarks/gpu_suite.sh base COMMIT, then carry .base" >&2; return 1; }
  local runs=() name n
  step cuda-graphs 60 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_model.py tests/test_forks.py
  for n in 128 128 128 512; do
    for tree in after before; do
      name=saturate-$n-$tree-${#runs[@]}
      if [ $tree = after ]; then
        benchmark "$name" 45 -- --workload saturate --numsamples $n --modes dynamic
      else  # the same benchmark from the tree before, its results here
        step "$name" 45 env -C .base MODEL="${MODEL:-random:gpt2-medium}" "$PY" client/benchmark.py --workload saturate \
          --numsamples $n --modes dynamic --report --out "$ROOT/$RESULTS/$name"
      fi
      runs+=("$name")
    done
  done
  benchmark saturate-512-after-switch 45 SWITCH_INTERVAL_MS=0.5 -- --workload saturate --numsamples 512 --modes dynamic
  benchmark seed-like-dynamic 65 -- --workload seed-like --numsamples 40 --modes dynamic
  step benchmark-safety 60 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_benchmark_safety.py
  archive host-ab "${runs[@]}" saturate-512-after-switch seed-like-dynamic
}

stream_interval() {  # ~9 minutes at most: tokens per streamed event against the host's Python, in turns
  step cuda-kernel-model 100 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_half_precision.py tests/test_model.py tests/test_forks.py \
    tests/test_prefix_cache.py tests/test_chunked_prefill.py tests/test_prompt_logprobs.py
  local runs=() n interval name
  for n in 128 128 512; do
    for interval in 1 8 32; do
      name=saturate-$n-interval-$interval-${#runs[@]}
      benchmark "$name" $((n == 128 ? 30 : 40)) STREAM_INTERVAL=$interval -- --workload saturate --numsamples $n \
        --modes dynamic
      runs+=("$name")
    done
  done
  benchmark saturate-baselines 120 -- --workload saturate --numsamples 128 --modes none \
    --baseline transformers,transformers-cb
  archive stream-interval "${runs[@]}" saturate-baselines
}

stream_interval_2() {  # ~6 minutes at most
  local runs=() interval name common=(--workload saturate --modes dynamic)
  for interval in 16 32 16 32; do
    name=saturate-128-interval-$interval-${#runs[@]}
    benchmark "$name" 30 STREAM_INTERVAL=$interval -- "${common[@]}" --numsamples 128
    runs+=("$name")
  done
  benchmark saturate-128-interval-32-switch 30 STREAM_INTERVAL=32 SWITCH_INTERVAL_MS=0.5 -- "${common[@]}" --numsamples 128
  benchmark saturate-512-interval-32-switch 40 STREAM_INTERVAL=32 SWITCH_INTERVAL_MS=0.5 -- "${common[@]}" --numsamples 512
  benchmark seed-like-interval-32 70 STREAM_INTERVAL=32 -- --workload seed-like --numsamples 40 --modes dynamic
  benchmark saturate-nobatch 90 -- --workload saturate --numsamples 128 --modes nobatch
  archive stream-interval-2 "${runs[@]}" saturate-128-interval-32-switch saturate-512-interval-32-switch \
    seed-like-interval-32 saturate-nobatch
}

# saturate_turns SUFFIX INTERVALS TREES: saturate (128 requests, dynamic) at each STREAM_INTERVAL with each tree
# (after: this one; base: .base) in turns; each run's name goes into the caller's runs
saturate_turns() {
  local interval tree name
  for interval in $2; do
    for tree in $3; do
      name=saturate-128-interval-$interval-$tree$1
      if [ $tree = after ]; then
        benchmark "$name" 30 STREAM_INTERVAL=$interval -- --workload saturate --numsamples 128 --modes dynamic
      else
        step "$name" 30 env -C .base STREAM_INTERVAL=$interval MODEL="${MODEL:-random:gpt2-medium}" "$PY" \
          client/benchmark.py --workload saturate --numsamples 128 --modes dynamic --report --out "$ROOT/$RESULTS/$name"
      fi
      runs+=("$name")
    done
  done
}

overlap() {  # ~9 minutes at most: the fused decode kernels and asynchronous scheduling, against .base in turns
  step cuda-kernel-model 150 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_triton_*.py \
    tests/test_async_scheduling.py tests/test_half_precision.py tests/test_model.py tests/test_forks.py \
    tests/test_prefix_cache.py tests/test_chunked_prefill.py
  local decode=("$PY" -m benchmarks.decode_step --batch-sizes 1,32,128,256 --context 200 --steps 20)
  step decode-after 45 "${decode[@]}" --profile
  step decode-after-sync 30 env ASYNC_SCHEDULING=off "${decode[@]}"
  step decode-base 30 env -C .base "${decode[@]}"
  local runs=()
  saturate_turns "" "1 32" "after base"
  step cuda-servers 110 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_server.py \
    -k "greedy or concurrent or stream_interval"
  archive overlap "${runs[@]}"
}

overlap_2() {  # ~4 minutes at most: the overlap stage's saturate again in turns, 512 requests, seed-like (40)
  local runs=()
  saturate_turns -2 "32 1" "base after"
  benchmark saturate-512-interval-32-after 40 STREAM_INTERVAL=32 -- --workload saturate --numsamples 512 --modes dynamic
  benchmark seed-like-after 70 -- --workload seed-like --numsamples 40 --modes dynamic
  step decode-after-2 30 "$PY" -m benchmarks.decode_step --batch-sizes 1,32,128,256 --context 200 --steps 20
  archive overlap-2 "${runs[@]}" saturate-512-interval-32-after seed-like-after
}

host_profile() {  # ~7 minutes at most: this tree's correctness on the GPU, then where the host's time goes
  step versions 20 "$PY" -c "import sys, torch, triton, transformers as t; print(sys.version, 'torch', torch.__version__,
torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__, 'transformers', t.__version__)"
  step cuda-kernel-model 150 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_triton_*.py \
    tests/test_async_scheduling.py tests/test_half_precision.py tests/test_model.py tests/test_forks.py \
    tests/test_prefix_cache.py tests/test_chunked_prefill.py
  step cuda-servers 110 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_server.py \
    -k "greedy or concurrent or stream_interval"
  step decode 45 "$PY" -m benchmarks.decode_step --batch-sizes 128,256 --context 200 --steps 20
  step profile-128 60 env MODEL="${MODEL:-random:gpt2-medium}" bash benchmarks/host_profile.sh 128 2 "$RESULTS/profile"
  local runs=()
  saturate_turns "" "1 32" "after"
  saturate_turns -2 "1 32" "after"
  benchmark saturate-512-interval-1 40 -- --workload saturate --numsamples 512 --modes dynamic
  benchmark seed-like 70 -- --workload seed-like --numsamples 40 --modes dynamic
  archive host-profile "${runs[@]}" saturate-512-interval-1 seed-like
}

tree_ab() {  # ~4 minutes at most: is a change of speed the tree's or the machine's? Both trees, one machine, in turns
  [ -f .base/client/benchmark.py ] || { echo "no .base/: bash benchmarks/gpu_suite.sh base COMMIT, then carry .base" >&2; return 1; }
  local decode=("$PY" -m benchmarks.decode_step --batch-sizes 128,256 --context 200 --steps 20)
  step decode-after 40 "${decode[@]}"
  step decode-base 40 env -C .base "${decode[@]}"
  local runs=()
  saturate_turns "" "1" "base after base after"
  benchmark saturate-128-interval-1-switch 30 SWITCH_INTERVAL_MS=0.5 -- --workload saturate --numsamples 128 --modes dynamic
  archive tree-ab "${runs[@]}" saturate-128-interval-1-switch
}

engine_process() {  # ~6 minutes at most: ENGINE_PROCESS off against on, 1 and 4 front ends, the same machine, in turns
  step cuda-engine-process 80 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_engine_process.py \
    -k "every_mode and dynamic or in_process"
  # layouts: one process; the engine's process with one front end; with four (API_SERVER_COUNT)
  local runs=() layout name common=(--workload saturate --modes dynamic) fronts
  for layout in off on on-4 off on on-4; do
    name=saturate-128-interval-1-engine-$layout-${#runs[@]}
    fronts=${layout#on-}; [ "$fronts" = "$layout" ] && fronts=1
    benchmark "$name" 30 ENGINE_PROCESS=${layout%%-*} API_SERVER_COUNT=$fronts -- "${common[@]}" --numsamples 128
    runs+=("$name")
  done
  benchmark saturate-128-interval-32-engine-on 30 ENGINE_PROCESS=on STREAM_INTERVAL=32 -- "${common[@]}" --numsamples 128
  for fronts in 1 4; do
    benchmark saturate-512-interval-1-engine-on-$fronts 40 API_SERVER_COUNT=$fronts -- "${common[@]}" --numsamples 512
    runs+=(saturate-512-interval-1-engine-on-$fronts)
  done
  benchmark seed-like-engine-on 45 ENGINE_PROCESS=on -- --workload seed-like --numsamples 20 --modes dynamic
  local decode=("$PY" -m benchmarks.decode_step --batch-sizes 128,256 --context 200 --steps 20)
  step decode-after 30 "${decode[@]}"
  [ -f .base/client/benchmark.py ] && step decode-base 30 env -C .base "${decode[@]}"
  archive engine-process "${runs[@]}" saturate-128-interval-32-engine-on seed-like-engine-on
}

front_ends() {  # ~6.5 minutes at most: the engine's process behind 1, 2 and 4 front ends, in turns
  local runs=() fronts name i=0 common=(--workload saturate --modes dynamic)
  for fronts in 1 2 4 4 2 1; do
    name=saturate-128-interval-1-fronts-$fronts-$((i++))
    benchmark "$name" 35 API_SERVER_COUNT=$fronts -- "${common[@]}" --numsamples 128
    runs+=("$name")
  done
  benchmark saturate-128-interval-32-fronts-4 35 API_SERVER_COUNT=4 STREAM_INTERVAL=32 -- "${common[@]}" --numsamples 128
  for fronts in 1 4; do
    benchmark saturate-512-interval-1-fronts-$fronts 45 API_SERVER_COUNT=$fronts -- "${common[@]}" --numsamples 512
    runs+=(saturate-512-interval-1-fronts-$fronts)
  done
  benchmark seed-like-fronts-1 50 -- --workload seed-like --numsamples 20 --modes dynamic
  archive front-ends "${runs[@]}" saturate-128-interval-32-fronts-4 seed-like-fronts-1
}

kv_check() {  # ~7 minutes at most: kv-cache's tests and decode steps (not its saturate), then greedy output and the
  # engine process's answers through real servers on CUDA
  kv_kernels 50
  step cuda-engine-process 120 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_server.py \
    tests/test_engine_process.py -k "greedy_output and on or every_answer"
  archive kv-check
}

servers() {  # ~4.5 minutes at most: real servers at a 7-token step budget, then the API at the default one
  step cuda-servers-budget-7 150 env DTYPE=float32 MAX_BATCH_TOKENS=7 "$PY" -m pytest -q -ra -p no:cacheprovider \
    tests/test_server.py -k "transformers or alone"
  step cuda-openai 110 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_openai.py
}

kv_kernels() {  # kv_kernels LIMIT: KV_CACHE_DTYPE's quantized caches through the Triton kernels and CUDA graphs, each
  # decode step under LIMIT seconds
  step versions 20 "$PY" -c "import sys, torch, triton, transformers as t; print(sys.version, 'torch', torch.__version__,
torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability(), 'triton', triton.__version__)"
  # Every kernel test on the compiled kernels: over int8 and both float8 caches (against attention over the
  # dequantized cache, and within the bound quantization sets of the float cache's; the store kernel bit for bit
  # against model.attention.quantize; greedy tokens from captured graphs against the reference backend's over the
  # same cache dtype), and the float caches' tests, whose kernels take the new arguments too
  step cuda-kv-kernel 130 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_triton_attention.py
  # One decode step of 256 sequences: prompts of 960 tokens (context + generated must stay within gpt2-medium's 1,024
  # positions; a budget of 8,192 prefills them in 31 steps), so the timed steps attend over ~1,005 keys each. The
  # floor counts each cache dtype's bytes (benchmarks/decode_step.py, step_bytes)
  local decode=("$PY" -m benchmarks.decode_step --batch-sizes 256 --context 960 --steps 20) cache
  for cache in auto int8 fp8; do
    step decode-kv-$cache "$1" env MAX_BATCH_TOKENS=8192 KV_CACHE_DTYPE=$cache "${decode[@]}"
  done
}

kv_cache() {  # ~8 minutes at most: kv_kernels, then saturate (256) over each cache dtype
  kv_kernels 75
  local runs=()
  for cache in auto int8 fp8; do
    benchmark saturate-256-kv-$cache 45 KV_CACHE_DTYPE=$cache -- --workload saturate --numsamples 256 --modes dynamic
    runs+=("saturate-256-kv-$cache")
  done
  archive kv-cache "${runs[@]}"
}

tune() {
  local decode=("$PY" -m benchmarks.decode_step --batch-sizes 1,32,128,256 --context 200)
  step decode-triton 150 "${decode[@]}" --profile
  step decode-reference 120 env ATTENTION_BACKEND=reference CUDA_GRAPHS=off "${decode[@]}"
  step kernel-sweep 200 "$PY" -m benchmarks.decode_step --sweep --batch-sizes 32,128,256 --context 200 --steps 20
  archive tune
}

saturate() {
  local common=(--workload saturate --numsamples 128)
  benchmark saturate-batched 260 -- "${common[@]}" --modes static,dynamic
  # "before": the same dynamic run with the kernel and graphs off and nothing else changed
  benchmark saturate-before 200 ATTENTION_BACKEND=reference CUDA_GRAPHS=off -- "${common[@]}" --modes dynamic
  archive saturate saturate-batched saturate-before
}

saturate_others() {
  local common=(--workload saturate --numsamples 128)
  benchmark saturate-nobatch 240 -- "${common[@]}" --modes nobatch
  benchmark saturate-baselines 300 -- "${common[@]}" --modes none --baseline transformers,transformers-cb
  archive saturate-others saturate-nobatch saturate-baselines
}

seed_like() {
  benchmark seed-like-nobatch 180 -- --workload seed-like --modes nobatch
  benchmark seed-like-static 170 -- --workload seed-like --modes static
  benchmark seed-like-dynamic 170 -- --workload seed-like --modes dynamic
  archive seed-like seed-like-nobatch seed-like-static seed-like-dynamic
}

seed_like_baselines() {
  benchmark seed-like-baselines 330 -- --workload seed-like --modes none --baseline transformers,transformers-cb
  archive seed-like-baselines seed-like-baselines
}

[ $# -gt 0 ] || { sed -n '2,62p' "$0"; exit 2; }
for stage in "$@"; do
  case $stage in
    wheels) wheels; continue ;;
    base) shift; rm -rf .base && mkdir .base && git archive "$1" | tar -x -C .base && rm -rf .base/docs && echo ".base: $1"; exit ;;
    first-light | tuned | one-by-one | host-ab | stream-interval | stream-interval-2 | overlap | host-profile | tree-ab | engine-process | overlap-2 | servers | kv-cache | front-ends | kv-check | check | tune | saturate | saturate-others | seed-like | seed-like-baselines) ;;
    *) echo "unknown stage: $stage" >&2; exit 2 ;;
  esac
  install_wheels
  rm -rf "$RESULTS" && mkdir -p "$RESULTS"
  "${stage//-/_}" 2>&1 | tee "$OUT/$stage.log"
done
cat "$SUMMARY"

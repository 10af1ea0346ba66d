#!/usr/bin/env bash
# The GPU checks and measurements of the README, in stages that each end well inside ten minutes.
#
#   bash benchmarks/gpu_suite.sh wheels          # with network: what a bare GPU image lacks, into .whl/
#   bash benchmarks/gpu_suite.sh check           # versions, the CUDA tests, decode steps with both backends
#   bash benchmarks/gpu_suite.sh saturate        # saturate with the transformers baseline, and the same
#                                                #   dynamic run without the kernel and graphs ("before")
#   bash benchmarks/gpu_suite.sh seed-like       # seed-like with the baseline
#   bash benchmarks/gpu_suite.sh check saturate  # stages run in the order given
#
# On a machine without the server's packages it installs the wheels in .whl/ (if any) into
# /tmp/site first. Each stage writes one log and, for the benchmarks, one .tar.gz of the
# results directory into $OUT (default results/gpu), and the last lines it prints are a table
# of what ran, how long it took and whether it passed (also in $OUT/summary.txt). A failing step
# does not stop the rest. At most six files reach $OUT, to be copied back from the GPU machine.
set -uo pipefail
cd "$(dirname "$0")/.." || exit

OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1  # no progress bars in the logs
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

wheels() {  # the server's and the tests' packages for Python 3.12 on x86-64 Linux, with their needs
  rm -rf .whl && mkdir .whl
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl flask gunicorn python-dotenv openai
  ls .whl
}

install_wheels() {
  "$PY" -c "import flask, gunicorn, dotenv, openai" 2>/dev/null && return
  ls .whl/*.whl >/dev/null 2>&1 || { echo "flask, gunicorn, python-dotenv or openai missing, and no .whl/" >&2; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output into the stage's log
  local name=$1 limit=$2 start rc
  shift 2
  echo "=== $name: $*"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  printf '%-18s %5ss  %s\n' "$name" "$(($(date +%s) - start))" "$([ $rc = 0 ] && echo ok || echo "FAILED ($rc)")" >>"$SUMMARY"
}

check() {
  step nvidia-smi 30 nvidia-smi
  step versions 60 "$PY" -c "import sys, torch, triton, transformers as t; print(sys.version, 'torch', torch.__version__,
torch.version.cuda, torch.cuda.get_device_name(), 'triton', triton.__version__, 'transformers', t.__version__)"
  # Greedy output against transformers through the kernel and graph capture, in float32 and in half
  # precision; then every mode and the API through real servers (kernel and graphs, in float32).
  step cuda-tests 300 env DTYPE=float32 "$PY" -m pytest -q -ra -p no:cacheprovider \
    tests/test_triton_attention.py tests/test_half_precision.py tests/test_model.py tests/test_forks.py \
    tests/test_prefix_cache.py tests/test_chunked_prefill.py tests/test_prompt_logprobs.py \
    tests/test_server.py tests/test_openai.py
  step decode-triton 90 "$PY" -m benchmarks.decode_step --batch-sizes 1,32,128,256 --context 200
  step decode-reference 90 env ATTENTION_BACKEND=reference CUDA_GRAPHS=off \
    "$PY" -m benchmarks.decode_step --batch-sizes 1,32,128,256 --context 200
}

saturate() {
  export MODEL=${MODEL:-random:gpt2-medium}
  step saturate 330 "$PY" client/benchmark.py --workload saturate --numsamples 128 --baseline --report \
    --out results/gpu/saturate
  step saturate-before 150 env ATTENTION_BACKEND=reference CUDA_GRAPHS=off CHUNKED_PREFILL=off \
    "$PY" client/benchmark.py --workload saturate --numsamples 128 --modes dynamic --out results/gpu/saturate-before
  tar czf "$OUT/saturate-results.tar.gz" -C results/gpu saturate saturate-before
}

seed_like() {
  export MODEL=${MODEL:-random:gpt2-medium}
  step seed-like 540 "$PY" client/benchmark.py --workload seed-like --baseline --report --out results/gpu/seed-like
  tar czf "$OUT/seed-like-results.tar.gz" -C results/gpu seed-like
}

[ $# -gt 0 ] || { sed -n '2,9p' "$0"; exit 2; }
for stage in "$@"; do
  case $stage in
    wheels) wheels; continue ;;
    check | saturate | seed-like) ;;
    *) echo "unknown stage: $stage" >&2; exit 2 ;;
  esac
  install_wheels
  "${stage//-/_}" 2>&1 | tee "$OUT/$stage.log"
done
cat "$SUMMARY"

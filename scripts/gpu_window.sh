#!/usr/bin/env bash
# Is the steer kernel ready to serve on this GPU? One call, about 3 minutes (make gpu-window):
#   1. the kernel, dispatch and serving tests on CUDA (VLLM_STEER_TEST_DEVICE=cuda:
#      tests/core/test_kernels.py, test_ops.py, test_kernel_serving.py, test_kernel_fixed.py;
#      Triton compiled for the GPU, not interpreted; real CUDA graphs of the head's op);
#   2. scripts/gpu_window.py: no Triton compile after ops.warm_up for rows 1..256 (counted in
#      the kernels' Triton caches), batch invariance at 1/7/64/256 rows with
#      VLLM_BATCH_INVARIANT=1, the steer op refused inside CUDA graph capture, steered steps
#      run one step ahead after a CUDA-graph forward against the formula (scripts/
#      gpu_async_steps.py), the timings behind the `auto` backend rule (reported, never
#      a failure), and the LM head's steer op replayed from CUDA graphs against its eager
#      launch: host us per steered step (goal: at most 20), GPU us, rows against the formula.
# Needs python3 with torch (CUDA), triton and pytest; no vLLM, no network, no install. Run from
# the repository root (the script cds there and puts it on PYTHONPATH).
# Output: the terminal and, when $OUT is set, $OUT/gpu_window.log (all of it) and
# $OUT/gpu_window_results.txt (one line per check).
# Exit status: 0 when every test and check passes, 1 otherwise, 2 when python/torch/triton
# are missing.
# Without CUDA it is a dry run: the CUDA tests and checks are skipped with a line saying so,
# and the batch-invariance check runs under Triton's interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  : > "$OUT/gpu_window_results.txt"
  exec > >(tee -a "$OUT/gpu_window.log") 2>&1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET VLLM_STEER_BACKEND VLLM_BATCH_INVARIANT VLLM_STEER_TILES

echo "== gpu_window: $(date -u +%FT%TZ) in $ROOT"
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)" \
  || { echo "gpu_window: FAIL: python3 with torch and triton is needed"; exit 2; }
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")

STATUS=0
if [ "$CUDA" = 1 ]; then
  echo
  echo "== 1. kernel, dispatch and serving tests on CUDA"
  VLLM_STEER_TEST_DEVICE=cuda timeout 300 "$PY" -m pytest tests/core/test_kernels.py \
    tests/core/test_ops.py tests/core/test_kernel_serving.py tests/core/test_kernel_fixed.py \
    -q -ra -p no:cacheprovider
  TESTS=$?
  LINE="tests on CUDA: pytest exit $TESTS: $([ "$TESTS" -eq 0 ] && echo PASS || echo FAIL)"
  echo "$LINE"
  [ -n "${OUT:-}" ] && echo "$LINE" >> "$OUT/gpu_window_results.txt"
  [ "$TESTS" -eq 0 ] || STATUS=1
  echo
  echo "== 2. serving checks: compiles, batch invariance, capture, async, auto, replay"
  timeout 300 "$PY" scripts/gpu_window.py || STATUS=1
else
  echo
  echo "== 1. SKIP: no CUDA here, so no kernel tests on CUDA (make test-fast runs them on CPU)"
  echo
  echo "== 2. serving checks, dry run on CPU (Triton's interpreter)"
  TRITON_INTERPRET=1 timeout 300 "$PY" scripts/gpu_window.py --dry-run || STATUS=1
fi

echo
if [ "$STATUS" -eq 0 ]; then
  echo "gpu_window: PASS"
else
  echo "gpu_window: FAIL"
fi
exit "$STATUS"

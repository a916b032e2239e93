#!/usr/bin/env bash
# The whole GPU check of the batched steer kernel in one call (make gpu-check):
#   1. the kernel and dispatch tests on CUDA (tests/test_kernels.py, tests/test_ops.py with
#      VLLM_STEER_TEST_DEVICE=cuda: the Triton kernel compiled for the GPU, not interpreted);
#   2. the benchmark's goal shapes (--quick: d 576/4096, rows 1/256, K 1/8/64, rank 64/full);
#   3. the full sweep (d 576..8192, rows 1..512, K 1/8/64, rank 64/1024/full), pattern
#      "distinct", stopped after $BENCH_BUDGET_S seconds (default 240; 0 skips it).
# Needs python3 with torch (CUDA), triton and pytest. No vLLM, no package registry, no install:
# when vllm_steer.kernels is not importable (the package is not pip-installed), the sources are
# staged into a temporary folder with kernels/ at vllm_steer/kernels, as setup.py installs it.
# Output goes to the terminal and, when $OUT is set, to $OUT/gpu_check.log (all of it) and
# $OUT/kernel_bench_quick.txt, $OUT/kernel_bench_full.txt (the tables).
# Exit status: 0 when the tests pass (the benchmark reports, it does not fail the check).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
BUDGET=${BENCH_BUDGET_S:-240}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET VLLM_STEER_BACKEND

echo "== gpu_check: $(date -u +%FT%TZ) in $ROOT"
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$PY" - <<'EOF' || { echo "gpu_check: FAIL: python/torch/triton/CUDA not usable"; exit 2; }
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
import triton
print("triton", triton.__version__)
assert torch.cuda.is_available(), "CUDA is not available to torch"
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
import pytest  # noqa: F401
EOF

# Make `import vllm_steer.kernels` work without installing anything.
WORK=$ROOT
if ! (cd "$ROOT" && "$PY" -c "import vllm_steer.kernels" 2>/dev/null); then
  STAGE=$(mktemp -d)/vllm-steer
  mkdir -p "$STAGE"
  cp -r vllm_steer tests benchmarks pytest.ini "$STAGE"/
  cp -r kernels "$STAGE/vllm_steer/kernels"
  find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
  WORK=$STAGE
  echo "== vllm_steer is not installed: staged the sources in $STAGE"
fi
cd "$WORK"
"$PY" -c "import vllm_steer.kernels as k; print('kernels:', k.__file__, '| triton backend:', k.HAS_TRITON)"

echo
echo "== 1. kernel tests on CUDA"
VLLM_STEER_TEST_DEVICE=cuda "$PY" -m pytest tests/test_kernels.py tests/test_ops.py \
  -q -ra -p no:cacheprovider
TESTS=$?

echo
echo "== 2. benchmark: goal shapes"
"$PY" benchmarks/kernel_bench.py --device cuda --quick \
  | tee "${OUT:-/tmp}/kernel_bench_quick.txt"

if [ "$BUDGET" != "0" ]; then
  echo
  echo "== 3. benchmark: full sweep (pattern distinct, budget ${BUDGET}s)"
  # The sizes the goal-shape run did not cover first, in case the budget cuts the sweep.
  "$PY" benchmarks/kernel_bench.py --device cuda --pattern distinct --budget-s "$BUDGET" \
    --d 2048 8192 4096 576 \
    | tee "${OUT:-/tmp}/kernel_bench_full.txt"
fi

echo
if [ "$TESTS" -eq 0 ]; then
  echo "gpu_check: tests PASS"
else
  echo "gpu_check: tests FAIL (pytest exit $TESTS)"
fi
exit "$TESTS"

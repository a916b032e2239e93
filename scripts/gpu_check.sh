#!/usr/bin/env bash
# The whole GPU check of the batched steer kernel in one call (make gpu-check):
#   1. the kernel, dispatch and serving tests on CUDA (tests/core/test_kernels.py, test_ops.py,
#      test_kernel_serving.py with VLLM_STEER_TEST_DEVICE=cuda: the Triton kernel compiled for
#      the GPU, not interpreted);
#   2. the benchmark's goal shapes (--quick: d 576/4096, rows 1/256, K 1/8/64, rank 64/full);
#   3. the full sweep (d 576..8192, rows 1..512, K 1/8/64, rank 64/1024/full), pattern
#      "distinct", stopped after $BENCH_BUDGET_S seconds (default 240; 0 skips it).
# Needs python3 with torch (CUDA), triton and pytest. No vLLM, no package registry, no install:
# the checkout itself is on the path (vllm_steer.kernels is a plain subpackage).
# Output goes to the terminal and, when $OUT is set, to $OUT/gpu_check.log (all of it) and
# $OUT/kernel_bench_quick.txt, $OUT/kernel_bench_full.txt (the tables).
# Exit status: 0 when the tests pass (the benchmark reports, it does not fail the check).
#
# With vLLM installed on the machine (scripts/gpu_vllm_carry.py; PYTHONPATH=/tmp/site), the
# plugin in real GPU engines (each part runs in under 10 minutes):
#   bash scripts/gpu_check.sh vllm-check   scripts/gpu_vllm_check.py --device cuda: bf16 and fp32,
#                                           V2 and V1, CUDA graphs and async scheduling on
#   bash scripts/gpu_check.sh vllm-bench [smollm2|8b]
#                                           benchmarks/bench_throughput.py at batch 1, 32, 256
#                                           (K = 16/64/256 where batch >= K), CUDA graphs on,
#                                           then (smollm2) benchmarks/profile_plugin.py: the plugin's host time
set -uo pipefail
MODE=${1:-kernels}
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
BUDGET=${BENCH_BUDGET_S:-240}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET VLLM_STEER_BACKEND VLLM_BATCH_INVARIANT

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

if [ "$MODE" = vllm-check ] || [ "$MODE" = vllm-bench ]; then
  "$PY" -c "import vllm; print('vllm', vllm.__version__, vllm.__file__)" \
    || { echo "gpu_check: FAIL: vLLM is not importable (carry it: python3 scripts/gpu_vllm_carry.py plan)"; exit 2; }
  # vLLM finds the plugin through its entry point: put the package's metadata on the path
  # (read from setup.py; no build, no install) where the package is not installed.
  META=$("$PY" -c "import os, sys; from pathlib import Path; sys.path.insert(0, 'scripts'); import gpu_vllm_check as g; print(g.plugin_path(dict(os.environ), Path('/tmp/steer_meta')) or '')") \
    || { echo "gpu_check: FAIL: could not write vllm_steer's entry points"; exit 2; }
  [ -n "$META" ] && export PYTHONPATH="$META${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$MODE" = vllm-check ]; then
  echo "== vLLM correctness on the GPU"
  "$PY" scripts/gpu_vllm_check.py --device cuda --out "${OUT:-/tmp}"
  exit $?
fi
if [ "$MODE" = vllm-bench ]; then
  WHICH=${2:-smollm2}
  if [ "$WHICH" = 8b ]; then
    MODEL=(--model benchmarks/configs/llama-3.1-8b.json --load-format dummy --dtype bfloat16)
  else
    MODEL=(--model smollm2)
  fi
  for B in ${BENCH_BATCHES:-1 32 256}; do
    KS=$(for k in 16 64 256; do [ "$k" -le "$B" ] && printf '%s,' "$k"; done)
    KS=${KS%,}; KS=${KS:-1}
    echo "== bench_throughput $WHICH batch $B K $KS"
    "$PY" benchmarks/bench_throughput.py "${MODEL[@]}" --batch "$B" --k-list "$KS" \
      --no-enforce-eager --gpu-memory-utilization 0.25 --repeats "${BENCH_REPEATS:-3}" \
      --out "${OUT:-/tmp}/bench_${WHICH}_b$B"
  done
  if [ "$WHICH" = smollm2 ]; then
    echo "== profile_plugin smollm2 (host time of the plugin's entry points per generate)"
    "$PY" benchmarks/profile_plugin.py --batch 32 --patterns 0,1,16
  fi
  exit 0
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import vllm_steer.kernels as k; print('kernels:', k.__file__, '| triton backend:', k.HAS_TRITON)"

echo
echo "== 1. kernel tests on CUDA"
VLLM_STEER_TEST_DEVICE=cuda "$PY" -m pytest tests/core/test_kernels.py tests/core/test_ops.py \
  tests/core/test_kernel_serving.py -q -ra -p no:cacheprovider
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

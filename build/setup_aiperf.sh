#!/usr/bin/env bash
# Idempotent: NVIDIA's aiperf in its own virtualenv (.venv-aiperf) from requirements-aiperf.txt, for
# tests/load/test_aiperf.py and benchmarks/aiperf.py. A separate venv because aiperf pins packages the stack
# pins differently (orjson, prometheus-client, numpy 2). Skipped when the stamp matches.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${AIPERF_VENV:-.venv-aiperf}
say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
stamp="$VENV/.requirements.sha256"
want=$(sha256sum requirements-aiperf.txt | cut -d' ' -f1)
[ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && exit 0
"$PYTHON" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 13) else 1)' \
  || { echo "[setup] error: aiperf 0.13.0 needs Python 3.11-3.13 ($PYTHON is $("$PYTHON" -V 2>&1)); set PYTHON=" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV for aiperf"
  "$PYTHON" -m venv "$VENV"
fi
say "installing aiperf from requirements-aiperf.txt (first run: a minute or two, ~1.2 GB)"
"$VENV/bin/pip" install --disable-pip-version-check -q -r requirements-aiperf.txt \
  || { echo "[setup] error: pip install aiperf failed (is PyPI reachable?)" >&2; exit 1; }
echo "$want" > "$stamp"

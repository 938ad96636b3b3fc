#!/usr/bin/env bash
# Debian services the tests start themselves: redis-server (shared rate limits), nginx (replicas) and
# postgresql (the usage ledger and batch store on PostgreSQL; tests/support/postgres.py runs a private one);
# libb64-0d for perf_analyzer; qemu-user, which runs the engine's int8 tests as an AVX2 CPU on any host
# (tests/engine/test_isa_paths.py).
set -euo pipefail
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
command -v promtool >/dev/null || missing+=(prometheus)
command -v qemu-x86_64 >/dev/null || missing+=(qemu-user)
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || missing+=(postgresql)  # promtool checks deploy/prometheus/rules.yml
# libb64.so.0d: .venv/bin/perf_analyzer (tritonclient wheel) links it (benchmarks/perf_analyzer.py)
[ -e /usr/lib/x86_64-linux-gnu/libb64.so.0d ] || ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d' || missing+=(libb64-0d)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "[setup] installing Debian packages: ${missing[*]}" >&2
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
command -v apt-get >/dev/null || { echo "[setup] error: apt-get not found; install ${missing[*]} by hand" >&2; exit 1; }
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# the packages start system services; the tests run their own instances
$SUDO service redis-server stop >/dev/null 2>&1 || true
$SUDO service nginx stop >/dev/null 2>&1 || true
$SUDO service prometheus stop >/dev/null 2>&1 || true
$SUDO service postgresql stop >/dev/null 2>&1 || true

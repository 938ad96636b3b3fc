#!/usr/bin/env bash
# The capacity benchmark on a borrowed host whose Python is not the project's venv (a GPU host's
# Python 3.12 with numpy 2.x and no network): the pinned packages it lacks travel as wheels and are
# installed into a venv of that interpreter whose site-packages then lists the interpreter's own after
# them (a .pth file): numpy 1.26.4 comes before its numpy 2.x, which the Triton 2.51 Python backend cannot
# use for BYTES tensors. A venv, not PYTHONPATH, because the backend's stubs take their sys.path from the
# venv (VIRTUAL_ENV) and ignore PYTHONPATH. Two steps, because one transfer is limited:
#
#   bash benchmarks/device/capacity.sh pack OUT.tar.xz [PYTHON_VERSION]   # here, with network (default 3.12)
#   bash benchmarks/device/capacity.sh install WHEELS_OR_TAR_XZ...         # there
#   bash benchmarks/device/capacity.sh run OUT_DIR PLAN    # PLAN: quick | full | scaling | verify | http | admission | targets | overheads | grouped | socket | short-scaling | adapters | protocols | wakeups
#
# Packages (cp312, manylinux, the versions of requirements.txt): nvidia-pytriton, numpy, python-rapidjson,
# tritonclient, starlette, uvicorn, httptools (the front's client HTTP), h11 (protocol_bench's peer), python-multipart,
# orjson (the front's HTTP engine reader): as wheels over two transfers
# (nvidia-pytriton alone is 53 MB), or unpacked once here and packed as one tar.xz of site-packages with
# only that Python's backend stub (`pack`: 47 MB). The tokenizer files
# of the prepared checkpoint (no weights: the simulated engine has none) are read from $TOKENIZER_FILES
# (default .devcache/SmolLM2-135M-Instruct) when .cache/models has none.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=${PY:-python3}
VENV=${VENV:-/tmp/bench-venv}
PY=$VENV/bin/python
export PYTHONUNBUFFERED=1
step=$1; shift
case "$step" in
pack)
  out=$1 pyver=${2:-3.12}
  tmp=$(mktemp -d)
  pin() { grep -iE "^$1(\[.*\])?==" requirements.txt | sed 's/\[.*\]//' | head -1; }
  plats=(); for n in 35 34 31 28 27 24 17 5; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${plats[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp/whl" \
    "$(pin nvidia-pytriton)" "$(pin numpy)" "$(pin tritonclient)" "$(pin starlette)" "$(pin uvicorn)" \
    "$(pin python-multipart)" "$(pin orjson)" "$(pin httptools)" "$(pin h11)" python-rapidjson
  mkdir -p "$tmp/site"
  for w in "$tmp"/whl/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done  # a wheel is a zip: no pip of $pyver here
  find "$tmp/site/pytriton/tritonserver/python_backend_stubs" -mindepth 1 -maxdepth 1 ! -name "$pyver" -exec rm -rf {} +
  chmod +x "$tmp"/site/pytriton/tritonserver/bin/* "$tmp"/site/pytriton/tritonserver/python_backend_stubs/*/*  # zipfile drops modes
  for d in "$tmp"/site/*.data; do  # a wheel's .data/purelib|platlib go into site-packages (tritonclient's do)
    for sub in purelib platlib; do if [ -d "$d/$sub" ]; then cp -a "$d/$sub/." "$tmp/site/"; fi; done
  done
  rm -rf "$tmp"/site/*.data
  tar -cf - -C "$tmp/site" . | xz -T0 -6 > "$out"
  rm -rf "$tmp"
  ls -l "$out"
  ;;
install)
  if [ ! -x "$PY" ]; then
    "$BASE" -m venv --without-pip "$VENV"
    base_site=$("$BASE" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$base_site" > "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/base-interpreter.pth"
  fi
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for f in "$@"; do  # wheels, or a tar.xz of installed packages (smaller: one transfer holds them all)
    case "$f" in
    *.whl) "$BASE" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$f" ;;
    *.tar.xz) tar -xJf "$f" -C "$site" ;;
    *) echo "install: $f is neither a wheel nor a .tar.xz" >&2; exit 2 ;;
    esac
  done
  if [ -d "$site/pytriton" ] && [ ! -f .cache/tritonserver/.installed ]; then
    "$PY" -c "from launcher.triton import install_runtime; install_runtime()"
  fi
  "$PY" build/token_lane.py || true  # the front's token lane for this Python (none: its Python path, said so)
  ;;
run)
  out=$1 plan=$2
  ckpt=.cache/models/SmolLM2-135M-Instruct
  if [ ! -f $ckpt/tokenizer.json ]; then mkdir -p $ckpt && cp -a "${TOKENIZER_FILES:-.devcache/SmolLM2-135M-Instruct}"/. $ckpt/; fi
  mkdir -p "$out"
  { nproc; lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-400; "$PY" --version; } > "$out/host.txt"
  work=$(mktemp -d)
  # each report as .json in OUT_DIR (its .md is made again from it: capacity_bench.markdown); what
  # tritonserver said when it died, if it did, in OUT_DIR/server-events.txt
  bench() {
    local name=$1; shift
    echo "== $name: $*"
    "$PY" benchmarks/capacity_bench.py "$@" --out "$work/$name.json" 2>&1 | grep -v '^\[capacity\]   ' || true
    cp "$work/$name.json" "$out/" 2>/dev/null || true
    log=$(ls -td /tmp/triton-stack-*/ 2>/dev/null | head -1 || true)server.log  # ls may take a SIGPIPE from head
    if grep -qE 'Signal \(([^1]|1[^5])|terminate called|Aborted|what\(\)' "$log" 2>/dev/null; then
      { echo "== $name ($log)"; grep -nE -B3 -A12 'Signal \(([^1]|1[^5])|terminate called|Aborted|what\(\)' "$log" | head -150; } >> "$out/server-events.txt"
    fi
  }
  admission() {  # the gateway's admit + settle pairs alone (ARGS: admission_bench's levels, requests, rounds and
    # prompt tokenizing), the answers sent by its loop and by 4 threads
    for t in 0 4; do
      echo "== admission, gateway_response_threads=$t"
      "$PY" benchmarks/admission_bench.py "$@" --protocol http --set gateway_response_threads=$t \
        --out "$out/admission-threads-$t.json" 2>&1 | grep -E "^\{|Error|error" || true
    done
  }
  E=${ENGINE_INSTANCES:-6}
  common=${COMMON:-"--duration 10 --warmup 4 --clients 8 --engine-instances $E"}  # COMMON: a shorter rehearsal here
  case "$plan" in
  quick) bench quick --levels 16 --layers ensemble,front --duration 3 --warmup 1 --clients 2 --engine-instances 2 --front-workers 2 ;;
  full)
    bench workers-4 --levels 16,64,256,1024 --layers ensemble,gateway,front $common --front-workers 4
    bench workers-2 --levels 256,1024 --layers front $common --front-workers 2
    bench workers-1 --levels 256,1024 --layers front $common --front-workers 1 ;;
  scaling)  # the front's worker processes at 256 and 1,024 streams, the ensemble beside the widest
    bench workers-8 --levels 256,1024 --layers ensemble,front $common --front-workers 8
    bench workers-4 --levels 256,1024 --layers front $common --front-workers 4
    bench workers-1 --levels 256,1024 --layers front $common --front-workers 1
    bench workers-2 --levels 256,1024 --layers front $common --front-workers 2 ;;
  verify)  # clients that all leave at once (the storm that aborted Triton 2.51), then 8 workers
    bench stop-storm --levels 256,1024 --layers front $common --front-workers 2 --end cancel
    bench workers-8 --levels 256,1024 --layers ensemble,front $common --front-workers 8 ;;
  http)  # since the front reads the engine over HTTP: the targets at 64-1,024 streams, workers 1 -> 2 -> 4, a storm
    bench http-workers-4 --levels 64,256,1024 --layers ensemble,front $common --front-workers 4
    bench http-workers-1 --levels 256 --layers front $common --front-workers 1
    bench http-workers-2 --levels 256 --layers front $common --front-workers 2
    bench http-stop-storm --levels 256,1024 --layers front $common --front-workers 4 --end cancel
    bench http-workers-6 --levels 256 --layers front $common --front-workers 6 ;;
  admission)  # the gateway's admit + settle rate alone (no engine), the operations over HTTP (the front's
    # default), the prompt tokenized by the gateway's preprocessing call or by the front (its default since
    # 2026-11-27), answered by the loop or by 4 threads; then the front at 256 streams (where it capped on
    # 2026-11-27) both ways, the engine read directly and through a TCP relay beside it (the floor of a
    # process between the engine and a client), and workers 1 -> 2 -> 4; first the front's Python alone, per
    # token (fast_lane_bench) and per request (protocol_bench), on these CPUs
    "$PY" benchmarks/fast_lane_bench.py --tokens 100000 --repeat 5 --out "$out/fast-lane.json" || true
    "$PY" benchmarks/protocol_bench.py --requests 10000 --repeat 5 --out "$out/protocol.json" || true
    admission --concurrency 16,64,256 --requests 2000 --rounds 2 --tokenize-max-bytes 0,4096
    bench admission-front-256-threads-0 --levels 256 --layers engine_http,engine_relay,front $common --front-workers 4 \
      --set gateway_response_threads=0
    bench admission-front-256-threads-4 --levels 256 --layers front $common --front-workers 4 \
      --set gateway_response_threads=4
    bench admission-front-256-workers-1 --levels 256 --layers front $common --front-workers 1
    bench admission-front-256-workers-2 --levels 256 --layers front $common --front-workers 2 ;;
  targets)  # issue 28's targets in one call: the front against the engine read directly at 64, 256 and 1,024
    # streams (4 workers), workers 1 -> 2 -> 4 at 256, the gateway's answers from 4 threads, the gateway's
    # admit + settle rate alone, and 4 and 2 workers at 256 again last (the host's drift within the call)
    "$PY" benchmarks/fast_lane_bench.py --tokens 100000 --repeat 3 --out "$out/fast-lane.json" || true
    bench targets-workers-4 --levels 64,256,1024 --layers engine_http,front $common --front-workers 4
    bench targets-workers-1 --levels 256 --layers front $common --front-workers 1
    bench targets-workers-2 --levels 256 --layers front $common --front-workers 2
    bench targets-threads-4 --levels 256 --layers front $common --front-workers 4 --set gateway_response_threads=4
    admission --concurrency 64,256 --requests 3000 --rounds 1 --tokenize-max-bytes 4096
    bench targets-workers-4-again --levels 256 --layers front $common --front-workers 4
    bench targets-workers-2-again --levels 256 --layers front $common --front-workers 2 ;;
  overheads)  # what the front adds per request beyond the engine's pace: the gateway's admit + settle alone
    # (its latency unloaded and its rate), each request's tail (last token to its end: the settle) at 256 and
    # 1,024 streams, and short requests (16 tokens: the request's own cost weighs 8x more per token) through
    # 1, 2 and 4 workers beside the engine read directly
    admission --concurrency 4,64,256 --requests 3000 --rounds 1 --tokenize-max-bytes 4096
    bench tail-workers-4 --levels 256,1024 --layers engine_http,front $common --front-workers 4
    bench short-workers-4 --levels 256 --layers engine_http,front $common --front-workers 4 --output-tokens 16
    bench short-workers-1 --levels 256 --layers front $common --front-workers 1 --output-tokens 16
    bench short-workers-2 --levels 256 --layers front $common --front-workers 2 --output-tokens 16 ;;
  grouped)  # the front's admits in groups (2026-11-28): the gateway's own Python per pair and its admit + settle
    # pairs alone, then 16- and 128-token requests through 4 workers at 256 streams (what `overheads` and
    # `targets` measured before)
    "$PY" benchmarks/gateway_policy_bench.py --pairs 20000 --repeat 3 --out "$out/gateway-policy.json" 2>&1 | grep group || true
    "$PY" benchmarks/admission_bench.py --concurrency 4,64,256 --requests 3000 --rounds 1 --protocol http \
      --tokenize-max-bytes 4096 --out "$out/admission-grouped.json" 2>&1 | grep -E "^\{|Error|error" || true
    bench grouped-short-workers-4 --levels 256 --layers front $common --front-workers 4 --output-tokens 16
    bench grouped-workers-4 --levels 256 --layers front $common --front-workers 4 ;;
  socket)  # the gateway's lease socket (2026-11-28): admit + settle pairs through Triton and on the socket,
    # alternated; 16-token requests at 256 streams through 4 workers with and without it; the 25,000 tok/s
    # target (128 tokens at 256 streams) on it, beside the engine read directly
    # from 4 client processes, as the front's 4 workers send them (one alone alternates with the gateway)
    "$PY" benchmarks/admission_bench.py --concurrency 4,64,256 --requests 3000 --rounds 1 --protocol http,socket \
      --tokenize-max-bytes 4096 --clients 4 --out "$out/admission-socket.json" 2>&1 | grep -E "^\{|Error|error" || true
    bench socket-short-workers-4 --levels 256 --layers front $common --front-workers 4 --output-tokens 16
    bench triton-short-workers-4 --levels 256 --layers front $common --front-workers 4 --output-tokens 16 --no-lease-socket
    bench socket-workers-4 --levels 256 --layers engine_http,front $common --front-workers 4 ;;
  short-scaling)  # front workers 1 -> 2 -> 4 where the engine is not the limit: 4-token requests at 256
    # streams (a request's own cost is most of the front's work, the engine's rate ~4,000 requests/s), the engine
    # read directly beside the widest, 4 then 1, 2 and 4 again (the host's drift within the call)
    bench short-scaling-workers-4 --levels 256 --layers engine_http,front $common --front-workers 4 --output-tokens 4
    bench short-scaling-workers-1 --levels 256 --layers front $common --front-workers 1 --output-tokens 4
    bench short-scaling-workers-2 --levels 256 --layers front $common --front-workers 2 --output-tokens 4
    bench short-scaling-workers-4-again --levels 256 --layers front $common --front-workers 4 --output-tokens 4 ;;
  adapters)  # requests naming a LoRA adapter (2026-11-29: they take leases now) at 256 streams through 4 workers,
    # beside the same requests without one and the engine read directly
    bench adapters-workers-4 --levels 256 --layers engine_http,front $common --front-workers 4 --adapter demo-bench
    bench plain-workers-4 --levels 256 --layers front $common --front-workers 4 ;;
  protocols)  # the engine read directly over gRPC (what the front does) and over HTTP generate_stream
    bench protocols --levels 64,256,1024 --layers engine_grpc,engine_http $common ;;
  wakeups)  # what a wake-up costs on these CPUs, and the front's per-token path after one (on the 2-core
    # guest, 2026-11-29: several times a wake on one core, and 7x the path's hot cost; docs/benchmarks.md),
    # beside the relay's and one front worker's CPU and wake-ups a token at 16 and 64 streams
    "$PY" benchmarks/wakeup_bench.py --repeat 3 --lane compiled,python --out "$out/wakeup-cost.json" || true
    bench wakeups --levels 16,64 --layers engine_relay,front $common --front-workers 1 ;;
  *) echo "run: PLAN is quick, full, scaling, verify, http, admission, targets, overheads, grouped, socket, short-scaling, adapters, protocols or wakeups" >&2; exit 2 ;;
  esac
  ;;
*) echo "usage: $0 pack OUT.tar.xz [PYTHON_VERSION] | install WHEELS_OR_TAR_XZ... | run OUT_DIR PLAN" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Runs tritonserver and the front in one container (deploy/docker-compose.yml), so that Triton's own
# HTTP and gRPC stay on the container's loopback and only the front's port is published.
#
#   run-pair.sh TRITONSERVER_COMMAND... -- FRONT_COMMAND...
#
# Both get one LLM_FRONT_KEY (the front streams from the engine and the gateway admits its requests) and
# one LLM_GATEWAY_SOCKET (where the gateway answers the front's lease operations).
# Whichever exits first stops the other and gives the container its exit code; SIGTERM and SIGINT go
# to both (tritonserver then drains within its --exit-timeout-secs).
set -u
triton=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do triton+=("$1"); shift; done
if [ "${1:-}" != "--" ] || [ ${#triton[@]} -eq 0 ] || [ $# -lt 2 ]; then
  echo "usage: run-pair.sh TRITONSERVER_COMMAND... -- FRONT_COMMAND..." >&2
  exit 2
fi
shift
# The front's key for its leases (docs/gateway.md), known to both processes and to no one else: drawn here
# at each start unless the environment sets one, as the CPU launcher draws it.
if [ -z "${LLM_FRONT_KEY:-}" ]; then
  LLM_FRONT_KEY=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
fi
export LLM_FRONT_KEY
# The gateway's lease socket (docs/gateway.md): the front's admits and settles past Triton, in a folder of
# this container's start only (mktemp -d: 0700), unless the environment names one (empty: none).
if [ -z "${LLM_GATEWAY_SOCKET+set}" ]; then
  if lease_dir=$(mktemp -d "${TMPDIR:-/tmp}/llm-lease-XXXXXX"); then
    LLM_GATEWAY_SOCKET="$lease_dir/gateway.sock"
  else  # no folder for it: said here, and the lease operations go through Triton
    echo "run-pair.sh: no folder for the gateway's lease socket in ${TMPDIR:-/tmp}; lease operations go through Triton" >&2
    LLM_GATEWAY_SOCKET=""
  fi
fi
export LLM_GATEWAY_SOCKET
"${triton[@]}" &
triton_pid=$!
"$@" &
front_pid=$!
stop() { kill -TERM "$triton_pid" "$front_pid" 2>/dev/null; }
trap stop TERM INT
wait -n "$triton_pid" "$front_pid"
rc=$?
stop
wait "$triton_pid" "$front_pid" 2>/dev/null
exit "$rc"

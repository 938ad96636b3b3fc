#!/usr/bin/env bash
# Runs tritonserver and the front in one container (deploy/docker-compose.yml), so that Triton's own
# HTTP and gRPC stay on the container's loopback and only the front's port is published.
#
#   run-pair.sh TRITONSERVER_COMMAND... -- FRONT_COMMAND...
#
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

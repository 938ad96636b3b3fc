"""`make serve`: the CPU repository in tritonserver (internal), the OpenAI-compatible front (public).

    python -m launcher [--repo runtime/model_repository] [--host 127.0.0.1] [--port 9000]
                       [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002] [--front-metrics-port 9002]

`--host/--port` are the public door (the front). Triton's own HTTP, gRPC and metrics stay on
`--triton-host` (loopback by default; in a container, an internal network at most). Ctrl-C or SIGTERM
drains: the front stops accepting and finishes in-flight requests (up to `--drain-timeout-s`), then
tritonserver stops, then nothing of either is left running.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from launcher.stack import Stack, StackConfig
from launcher.triton import ROOT


def banner(stack: Stack) -> str:
    c = stack.cfg
    return f"""
  The serving stack is ready (CPU engine, SmolLM2-135M-Instruct)
    OpenAI-compatible API  {stack.front_url}/v1        (the public door; API key required)
    internal only          Triton HTTP {stack.triton_http}  gRPC {stack.triton_grpc}
                           metrics http://{c.triton_host}:{c.metrics_port}/metrics and http://127.0.0.1:{c.front_metrics_port}/metrics
  Try:
    curl -s {stack.front_url}/v1/chat/completions -H 'Authorization: Bearer sk-demo-acme-enterprise' \\
      -d '{{"model": "auto", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32}}'
  Ctrl-C stops the stack (in-flight requests get {c.drain_timeout_s:.0f} s to finish).
"""


def main(argv=None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m launcher", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=ROOT / "runtime" / "model_repository")
    p.add_argument("--host", default=env("FRONT_HOST", "127.0.0.1"), help="the front's (public) address")
    p.add_argument("--port", type=int, default=int(env("FRONT_PORT", "9000")), help="the front's port")
    p.add_argument("--triton-host", default=env("TRITON_HOST", "127.0.0.1"), help="Triton's internal address")
    p.add_argument("--http-port", type=int, default=int(env("TRITON_HTTP_PORT", "8000")))
    p.add_argument("--grpc-port", type=int, default=int(env("TRITON_GRPC_PORT", "8001")))
    p.add_argument("--metrics-port", type=int, default=int(env("TRITON_METRICS_PORT", "8002")))
    p.add_argument("--front-metrics-port", type=int, default=int(env("FRONT_METRICS_PORT", "9002")))
    p.add_argument("--no-front", action="store_true", help="serve Triton only (internal use)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument("--log-verbose", type=int, default=int(env("TRITON_LOG_VERBOSE", "0")))
    p.add_argument("--data-dir", type=Path, default=Path(env("LLM_DATA_DIR", str(ROOT / "runtime" / "data"))),
                   help="usage ledger (SQLite, WAL) and the gateway's usage spool; created if missing")
    p.add_argument("--ledger-url", default=env("LLM_LEDGER_URL"),
                   help="postgresql://... : the ledger and batches in PostgreSQL (shared by replicas)")
    p.add_argument("--front-workers", type=int, default=int(env("FRONT_WORKERS", "1")),
                   help="processes of the front on its one port; the token stream scales out with them")
    p.add_argument("--no-engine-direct", action="store_true",
                   help="every token through the gateway (default: the front streams from the engine itself, "
                        "the gateway admitting and settling each request)")
    args = p.parse_args(argv)
    if not (args.repo / "ensemble" / "config.pbtxt").is_file():
        print(f"serve: no rendered repository at {args.repo}: run `make render`", file=sys.stderr)
        return 2
    stack = Stack(StackConfig(
        repo=args.repo.resolve(), host=args.host, port=args.port, triton_host=args.triton_host,
        http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        front_metrics_port=args.front_metrics_port, front=not args.no_front,
        drain_timeout_s=args.drain_timeout_s, log_verbose=args.log_verbose, data_dir=args.data_dir,
        ledger_url=args.ledger_url, front_workers=args.front_workers, engine_direct=not args.no_engine_direct))
    signal.signal(signal.SIGINT, lambda *_: stack.stopping.set())
    signal.signal(signal.SIGTERM, lambda *_: stack.stopping.set())
    try:
        stack.start()
    except (RuntimeError, TimeoutError, FileNotFoundError) as e:
        print(f"serve: {e}", file=sys.stderr)
        return 1
    print(banner(stack), file=sys.stderr, flush=True)
    code = stack.wait()
    print("serve: stopping (draining in-flight requests)", file=sys.stderr, flush=True)
    stack.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())

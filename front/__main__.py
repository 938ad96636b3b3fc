"""Run the OpenAI-compatible front: `python -m front [--host 0.0.0.0] [--port 9000] [--triton-grpc ...]`.

The front is the public door; the tritonserver it talks to stays on loopback or an internal network.
Its own metrics are served on a separate internal address (`--metrics-host/--metrics-port`).
"""
from __future__ import annotations

import argparse
import fcntl
import gc
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import uvicorn
from prometheus_client import start_http_server

from front.batch.jobs import BatchLimits
from front.app import Front, FrontSettings
from front.connections import PROTOCOL, ConnectionLimits, configure
from front.ledger_api import LedgerSettings
from front.gateway_client import GatewayClient
from front.metrics import FrontMetrics
from front import token_lane
from front.prompt_prep import DEFAULT_MAX_BYTES, PromptPreparer

DEFAULT_PORT = 9000
DEFAULT_METRICS_PORT = 9002


def parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m front", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=env("FRONT_HOST", "127.0.0.1"), help="address the API listens on")
    p.add_argument("--port", type=int, default=int(env("FRONT_PORT", DEFAULT_PORT)))
    p.add_argument("--triton-grpc", default=env("FRONT_TRITON_GRPC", "127.0.0.1:8001"),
                   help="tritonserver's gRPC address (internal)")
    p.add_argument("--triton-http", default=env("FRONT_TRITON_HTTP", "127.0.0.1:8000"),
                   help="tritonserver's HTTP address (internal): the engine's streams with --engine-protocol http")
    p.add_argument("--engine-protocol", choices=("grpc", "http"), default=env("FRONT_ENGINE_PROTOCOL", "http"),
                   help="how the front reads the engine's token streams (front/engine_direct.py): Triton's HTTP "
                        "generate_stream (front/engine_http.py), or a gRPC stream, which costs the front about twice "
                        "the CPU per token (benchmarks/results/2026-11-27-front-engine-protocol.json); the gateway's "
                        "lease operations go the same way")
    p.add_argument("--gateway-model", default="gateway")
    p.add_argument("--metrics-host", default=env("FRONT_METRICS_HOST", "127.0.0.1"),
                   help="address of the front's own /metrics (keep it internal)")
    p.add_argument("--metrics-port", type=int, default=int(env("FRONT_METRICS_PORT", DEFAULT_METRICS_PORT)),
                   help="0 turns the metrics listener off")
    p.add_argument("--max-body-bytes", type=int, default=FrontSettings.max_body_bytes)
    p.add_argument("--default-max-tokens", type=int, default=FrontSettings.default_max_tokens,
                   help="max_tokens when a request names none")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="bound on one generation")
    p.add_argument("--graceful-timeout-s", type=float, default=30.0,
                   help="on SIGTERM: stop accepting, let in-flight requests finish this long")
    p.add_argument("--drain-dir", default=env("LLM_DRAIN_DIR"),
                   help="a folder where `python -m launcher.drain front` marks a drain: /health/ready then answers "
                        "503 so load balancers stop sending requests (Kubernetes' preStop; unset: no marker read)")
    c = p.add_argument_group("client limits (front/connections.py; a slow or idle client holds nothing for long)")
    c.add_argument("--header-timeout-s", type=float, default=ConnectionLimits.header_timeout_s,
                   help="a request's line and headers must arrive within this after the connection opens, or after "
                        "their first bytes on a kept-alive connection")
    c.add_argument("--body-timeout-s", type=float, default=ConnectionLimits.body_timeout_s,
                   help="a request's whole body must arrive within this after its headers")
    c.add_argument("--idle-timeout-s", type=float, default=ConnectionLimits.idle_timeout_s,
                   help="a keep-alive connection with no request is closed after this")
    c.add_argument("--max-head-bytes", type=int, default=ConnectionLimits.max_head_bytes,
                   help="a request's line and headers may hold at most this many bytes (a 431 and a close beyond)")
    c.add_argument("--max-connections-per-client", type=int, default=ConnectionLimits.max_per_client,
                   help="connections one client address may hold at once (0: no bound; per worker process)")
    c.add_argument("--preauth-body-bytes", type=int, default=FrontSettings.preauth_body_bytes,
                   help="a larger body (or a chunked one) is read only after its key is checked, and only up to "
                        "its tier's bound (3 x max_prompt_bytes + 64 KiB)")
    c.add_argument("--bodies-in-flight-per-key", type=int, default=FrontSettings.bodies_in_flight_per_key,
                   help="a key's large bodies being read at once hold at most this many tier bounds (429 beyond)")
    c.add_argument("--early-retry-hold-s", type=float, default=FrontSettings.early_retry_hold_s,
                   help="a large body of a key refused rate_limited that comes back before its Retry-After waits "
                        "unread until then, at most this long, before it is answered (0: answered at once)")
    p.add_argument("--log-level", default=env("FRONT_LOG_LEVEL", "warning"))
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default=env("FRONT_LOOP", "uvloop"),
                   help="the event loop every worker runs: uvloop costs the front about 15%% less CPU per "
                        "streamed token than asyncio (benchmarks/results/2026-11-25-front-event-loop.json)")
    p.add_argument("--workers", type=int, default=int(env("FRONT_WORKERS", "1")),
                   help="processes serving the API on the one port (uvicorn's supervisor): a streamed token costs "
                        "CPU in the process that serves it, so the front scales out with cores; every worker's "
                        "metrics are on --metrics-port")
    p.add_argument("--tokenizer-dir", default=env("FRONT_TOKENIZER_DIR"),
                   help="the engine's tokenizer (an HF folder): with LLM_FRONT_KEY set, streams come straight "
                        "from the engine and are detokenized here, the gateway admitting and settling each "
                        "request (front/engine_direct.py); unset: every stream through the gateway")
    p.add_argument("--tokenize-max-bytes", type=int, default=int(env("FRONT_TOKENIZE_MAX_BYTES", str(DEFAULT_MAX_BYTES))),
                   help="with --tokenizer-dir: prompts up to this many characters are tokenized here and handed "
                        "to the gateway with the admission, larger ones by the gateway's preprocessing model "
                        "(tokenizing holds the worker's event loop; front/prompt_prep.py); 0: none here")
    p.add_argument("--token-lane", choices=token_lane.CHOICES, default=env("FRONT_TOKEN_LANE", "auto"),
                   help="with --tokenizer-dir over HTTP: each engine read's plain token events taken and written "
                        "to the client in C (front/token_lane.c, compiled by make setup) or in Python; auto: C "
                        "when built; compiled: C or refuse to start (docs/knobs.md)")
    g = p.add_argument_group("usage ledger and Batch API (docs/usage.md)")
    g.add_argument("--data-dir", default=env("LLM_DATA_DIR"),
                   help="the gateway's usage spool (<dir>/spool) and the SQLite ledger; unset: no ledger, "
                        "no batches")
    g.add_argument("--ledger-url", default=env("LLM_LEDGER_URL"),
                   help="postgresql://... to keep the ledger and batches in PostgreSQL (several replicas)")
    g.add_argument("--batch-concurrency", type=int, default=int(env("LLM_BATCH_CONCURRENCY", "2")),
                   help="batch lines this front's worker runs at once")
    g.add_argument("--batch-max-file-bytes", type=int, default=BatchLimits.max_file_bytes)
    g.add_argument("--batch-max-lines", type=int, default=BatchLimits.max_lines)
    g.add_argument("--replica-id", default=env("LLM_REPLICA_ID"),
                   help="this worker's id in the batch store (default host:port): a restarted replica "
                        "resumes the lines it held")
    return p


def build(args, worker: int | None = None) -> Front:
    """`worker`: this process's slot among --workers (None: the only process). Worker 0 alone moves the
    gateway's usage spool into the ledger store; each runs a batch worker of its own id."""
    metrics = FrontMetrics()
    if args.metrics_port and worker is None:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
    stopped = lambda how: metrics.engine_stops.labels(how).inc()  # noqa: E731 - how an abandoned stream ended

    def admits_sent(n: int) -> None:  # a request to the gateway with n admits (front/grouped_admits.py)
        metrics.admits.labels("alone" if n == 1 else "grouped").inc(n)
        if n > 1:
            metrics.admit_groups.inc()

    gateway = GatewayClient(args.triton_grpc, args.gateway_model, timeout_s=args.request_timeout_s, on_stop=stopped)
    ledger = None
    if args.data_dir:
        ledger = LedgerSettings(
            data_dir=Path(args.data_dir), ledger_url=args.ledger_url,
            batch=BatchLimits(args.batch_max_file_bytes, args.batch_max_lines,
                              default_max_tokens=args.default_max_tokens),
            batch_concurrency=args.batch_concurrency,
            worker_id=(args.replica_id or f"{socket.gethostname()}:{args.port}") + ("" if worker is None else f"/{worker}"),
            worker_key=os.environ.get("LLM_BATCH_WORKER_KEY"), write_spool=worker in (None, 0))
    direct = None
    if args.tokenizer_dir and os.environ.get("LLM_FRONT_KEY"):
        from text.detokenize import Detokenizer
        from text.preprocess import Preprocessor
        from text.tokenization import TokenizerBundle
        from front.engine_direct import DirectEngine

        tokenizer = TokenizerBundle.load(args.tokenizer_dir)
        detok = Detokenizer.from_tokenizer(tokenizer.tokenizer)
        prepare = PromptPreparer(Preprocessor(tokenizer, None), args.tokenize_max_bytes) \
            if args.tokenize_max_bytes > 0 else None
        from front.providers import UpstreamPath, Upstreams

        engine_http = None
        if args.engine_protocol == "http":
            from front.engine_http import EngineHttpClient

            engine_http = EngineHttpClient(args.triton_http, timeout_s=args.request_timeout_s)
        lease_socket = None
        if engine_http is not None and os.environ.get("LLM_GATEWAY_SOCKET"):  # the launcher's: docs/gateway.md
            from front.lease_socket import LeaseSocketClient

            lease_socket = LeaseSocketClient(os.environ["LLM_GATEWAY_SOCKET"], timeout_s=args.request_timeout_s)
        direct = DirectEngine(gateway, os.environ["LLM_FRONT_KEY"], detok, upstreams=UpstreamPath(Upstreams(metrics)),
                              on_stop=stopped, engine_http=engine_http, operations_http=engine_http, prepare=prepare,
                              on_admits=admits_sent, lease_socket=lease_socket,
                              on_channel=lambda channel: metrics.lease_requests.labels(channel).inc(),
                              on_lease=lambda operation, s: metrics.lease_operations.labels(operation).observe(s),
                              token_lane=token_lane.resolve(args.token_lane), on_hand_back=metrics.hand_backs.inc)
        metrics.token_lane.labels("python" if direct.token_lane is None else "compiled").set(1)
    configure(connection_limits(args), lambda reason: metrics.connections_closed.labels(reason).inc())
    settings = FrontSettings(args.max_body_bytes, args.default_max_tokens,
                             Path(args.drain_dir) if args.drain_dir else None, args.preauth_body_bytes,
                             bodies_in_flight_per_key=args.bodies_in_flight_per_key,
                             early_retry_hold_s=args.early_retry_hold_s)
    return Front(gateway, settings, metrics, ledger, direct, front_key=os.environ.get("LLM_FRONT_KEY") or None)


def connection_limits(args) -> ConnectionLimits:
    return ConnectionLimits(args.header_timeout_s, args.body_timeout_s, args.max_connections_per_client,
                            args.idle_timeout_s, args.max_head_bytes)


WORKER_ARGV, WORKER_DIR = "FRONT_WORKER_ARGV", "FRONT_WORKER_DIR"
_slot_lock = None  # the open lock file that holds this worker's slot for its lifetime


def _claim_slot(workers: int) -> int:
    """The lowest worker slot no live worker holds (a restarted worker takes its predecessor's)."""
    global _slot_lock
    for i in range(workers):
        f = open(Path(os.environ[WORKER_DIR]) / f"worker-{i}.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        _slot_lock = f
        return i
    raise RuntimeError(f"no free front worker slot among {workers}")


def worker_app():
    """uvicorn's factory in each of --workers processes."""
    args = parser().parse_args(json.loads(os.environ[WORKER_ARGV]))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s front %(levelname)s %(message)s")
    return serving_app(args, _claim_slot(args.workers))


def serve_workers(args, argv: list[str]) -> None:
    """--workers > 1: uvicorn's supervisor runs the workers on one socket; this process serves their
    metrics together (prometheus-client's multiprocess mode)."""
    run_dir = Path(tempfile.mkdtemp(prefix="llm-front-"))
    (run_dir / "metrics").mkdir()
    os.environ.update({WORKER_ARGV: json.dumps(argv), WORKER_DIR: str(run_dir),
                       "PROMETHEUS_MULTIPROC_DIR": str(run_dir / "metrics")})
    if args.metrics_port:
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(run_dir / "metrics"))
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
    try:
        uvicorn.run("front.__main__:worker_app", factory=True, workers=args.workers, host=args.host,
                    port=args.port, log_level=args.log_level, loop=args.loop, http=PROTOCOL, ws="none",
                    timeout_keep_alive=args.idle_timeout_s,
                    timeout_graceful_shutdown=args.graceful_timeout_s, server_header=False)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def raise_open_files_limit() -> None:
    """Every stream holds two sockets (its client's, and its own HTTP connection to the engine with
    --engine-protocol http, where gRPC multiplexes all on one): lift the soft limit on open files to the hard
    one (a service's soft limit is often 1,024)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def serving_app(args, worker: int | None = None):
    """The ASGI app of a front (build's `worker`), its heap frozen: what it built to serve (modules, the app,
    the tokenizer's tables) leaves the cyclic collector's reach, so a full pass walks what requests made
    since, not the whole heap, and the event loop, every stream with it, stalls a few ms where it stalled
    tens (llm_front_gc_pause_seconds; docs/benchmarks.md)."""
    app = build(args, worker).app()
    gc.collect()
    gc.freeze()
    return app


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    raise_open_files_limit()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s front %(levelname)s %(message)s")
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    try:
        token_lane.resolve(args.token_lane)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.workers > 1:
        serve_workers(args, argv)
        return 0
    app = serving_app(args)
    # the request line and headers are bounded in size and time by front/connections.py; no WebSocket
    # upgrade (its protocol would escape those bounds); grpc.aio shares the loop
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, loop=args.loop,
                http=PROTOCOL, ws="none", timeout_keep_alive=args.idle_timeout_s,
                timeout_graceful_shutdown=args.graceful_timeout_s, server_header=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

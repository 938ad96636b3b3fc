"""Command line: `python -m clients {chat,generate,models,usage,health}`.

    python -m clients generate "The capital of France is" --max-tokens 16 --api-key sk-...
    python -m clients generate "Hi" --model ensemble --transport http --no-stream   # no gateway, one response
    python -m clients chat --api-key sk-...          # interactive, streams tokens as they come
    python -m clients models                          # what the server serves and its state
    python -m clients usage                           # per-tenant tokens and cost from /metrics
    python -m clients usage --since 2026-11-01 --by day --format csv   # from the usage ledger (docs/usage.md)
    python -m clients health
The key can also come from $LLM_API_KEY; servers from --grpc/--http/--metrics or their defaults.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.llm import HTTPClient, LLMClient, LLMError  # noqa: E402
from clients.usage import families_by_tenant, fetch_metrics, format_usage, usage_from_metrics  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc", default=os.environ.get("LLM_GRPC_URL", "127.0.0.1:8001"))
    p.add_argument("--http", default=os.environ.get("LLM_HTTP_URL", "127.0.0.1:8000"))
    p.add_argument("--metrics", default=os.environ.get("LLM_METRICS_URL", "http://127.0.0.1:8002/metrics"))
    p.add_argument("--api-key", default=os.environ.get("LLM_API_KEY"))
    p.add_argument("--timeout", type=float, default=300.0)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("generate", "chat"):
        s = sub.add_parser(name)
        if name == "generate":
            s.add_argument("prompt")
        s.add_argument("--model", default=None, help="engine model or auto (gateway); 'ensemble' skips the gateway")
        s.add_argument("--adapter", default=None, help="gateway: a LoRA adapter name")
        s.add_argument("--transport", choices=("grpc", "http"), default="grpc",
                       help="gRPC stream (default) or HTTP /generate_stream (key as the api_key parameter)")
        s.add_argument("--no-stream", action="store_true", help="one response with the whole text")
        s.add_argument("--max-tokens", type=int, default=128)
        s.add_argument("--temperature", type=float, default=None)
        s.add_argument("--system", default=None, help="chat: system prompt")
    sub.add_parser("models")
    u = sub.add_parser("usage")
    u.add_argument("--all", action="store_true", help="every per-tenant gateway_* sample, not just the table")
    u.add_argument("--since", help="ledger report: first UTC day, YYYY-MM-DD (default: 30 days back)")
    u.add_argument("--until", help="ledger report: last UTC day, YYYY-MM-DD (default: today)")
    u.add_argument("--by", choices=("day", "model", "day_model", "provider"), help="ledger report: group per tenant by")
    u.add_argument("--format", choices=("table", "csv", "json"), help="ledger report: output format")
    u.add_argument("--tenant", help="ledger report: one tenant only")
    u.add_argument("--ledger", default=None,
                   help="ledger report: postgresql://... or a SQLite file (default $LLM_LEDGER_URL, else "
                        "$LLM_DATA_DIR/ledger.sqlite3, else runtime/data/ledger.sqlite3)")
    sub.add_parser("health")
    args = p.parse_args(argv)
    try:
        if args.cmd in ("generate", "chat"):
            via_ensemble = args.model == "ensemble"
            cls, url = (HTTPClient, args.http) if args.transport == "http" else (LLMClient, args.grpc)
            client = cls(url, args.api_key, model="ensemble" if via_ensemble else "gateway", timeout_s=args.timeout)
            opts = {"temperature": args.temperature, "streaming": not args.no_stream}
            if not via_ensemble:
                opts.update(model=args.model, adapter=args.adapter)
            if args.cmd == "generate":
                for piece in client.stream(args.prompt, max_tokens=args.max_tokens, **opts):
                    print(piece, end="", flush=True)
                print()
            else:
                chat(client, args, opts)
        elif args.cmd == "models":
            import tritonclient.http as httpclient

            from contracts.tensors import CONTRACTS

            # the repository index is an admin API (restricted by the launcher): ask each known model instead
            server = httpclient.InferenceServerClient(args.http)
            for name in CONTRACTS:
                state = "READY" if server.is_model_ready(name) else "UNAVAILABLE"
                print(f"{name:20} state={state}")
        elif args.cmd == "usage" and any(getattr(args, k) for k in ("since", "until", "by", "format", "tenant",
                                                                      "ledger")):
            return ledger_report(args)
        elif args.cmd == "usage":
            text = fetch_metrics(args.metrics)
            print(format_usage(usage_from_metrics(text)))
            if args.all:
                for tenant, fams in sorted(families_by_tenant(text).items()):
                    for name, value in sorted(fams.items()):
                        print(f"{tenant:16} {name:50} {value:g}")
        elif args.cmd == "health":
            import tritonclient.http as httpclient

            c = httpclient.InferenceServerClient(args.http)
            live, ready = c.is_server_live(), c.is_server_ready()
            print(f"live={live} ready={ready}")
            return 0 if live and ready else 1
    except LLMError as e:
        print(f"error ({e.kind}{', retry after %.1fs' % e.retry_after if e.retry_after else ''}): {e}",
              file=sys.stderr)
        return 1
    except (ConnectionError, OSError) as e:
        print(f"error: cannot reach the server: {e}", file=sys.stderr)
        return 1
    return 0


def ledger_report(args) -> int:
    """Requests, tokens in/out, cost, TTFT and latency p50/p95 per tenant per day (or model) from the ledger."""
    from ledger import reports
    from ledger.store import Store

    root = Path(__file__).resolve().parents[1]
    where = args.ledger or os.environ.get("LLM_LEDGER_URL") or str(
        Path(os.environ.get("LLM_DATA_DIR", root / "runtime" / "data")) / "ledger.sqlite3")
    if not where.startswith(("postgresql://", "postgres://")) and not Path(where).is_file():
        print(f"error: no usage ledger at {where} (start the stack with `make serve`, or pass --ledger)",
              file=sys.stderr)
        return 1
    try:
        start_ts, end_ts, _, _ = reports.window(args.since, args.until)
        store = Store.open(where)
        try:
            rows = store.usage_rows(args.tenant, start_ts, end_ts)
        finally:
            store.close()
        print(reports.render(reports.aggregate(rows, args.by or "day"), args.format or "table"))
    except reports.ReportError as e:
        print(f"error: {str(e).replace('start', '--since', 1).replace('end', '--until', 1)}", file=sys.stderr)
        return 2
    except Exception as e:  # sqlite3 / psycopg errors: the ledger cannot be read
        print(f"error: cannot read the usage ledger at {where}: {e}", file=sys.stderr)
        return 1
    return 0


def chat(client, args, opts) -> None:
    if client.model != "gateway":
        raise SystemExit("chat needs the gateway (chat messages are templated there)")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for piece in client.stream(messages=messages, max_tokens=args.max_tokens, **opts):
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    sys.exit(main())

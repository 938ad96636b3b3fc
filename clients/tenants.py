"""Manage gateway tenants: add one (prints its new API key once) or list them.

    python -m clients.tenants add NAME [--tier standard] [--config deploy/gateway.example.yaml]
                                     [--tokens-per-minute N] [--models m1,m2]
    python -m clients.tenants list [--config ...]

Only the key's SHA-256 digest is written; the file is validated before it replaces the old one, and
the running gateway picks the change up without a restart.
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tenants import LIMIT_FIELDS, ConfigError, hash_key, parse_config  # noqa: E402

DEFAULT = ROOT / "deploy" / "gateway.example.yaml"


def add_tenant(path: Path, name: str, tier: str, limits: dict, models: list[str] | None) -> str:
    raw = yaml.safe_load(path.read_text()) if path.exists() else {}
    raw = raw or {}
    tenants = raw.setdefault("tenants", {})
    if name in tenants:
        raise ConfigError(f"tenants.{name}: already exists")
    key = "sk-" + secrets.token_urlsafe(32)
    entry = {"tier": tier, "api_key_sha256": [hash_key(key)]}
    if limits:
        entry["limits"] = limits
    if models:
        entry["allowed_models"] = models
    tenants[name] = entry
    parse_config(raw)  # validate the whole file before writing it
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    os.replace(tmp, path)
    return key


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="add a tenant and print its key once")
    add.add_argument("name")
    add.add_argument("--tier", default="standard")
    add.add_argument("--models", help="comma-separated allowed models (default: all)")
    for f in LIMIT_FIELDS:
        add.add_argument("--" + f.replace("_", "-"), type=int, dest=f)
    ls = sub.add_parser("list", help="list tenants and their limits")
    for s in (add, ls):
        s.add_argument("--config", type=Path, default=DEFAULT)
    args = p.parse_args(argv)
    try:
        if args.cmd == "add":
            limits = {f: getattr(args, f) for f in LIMIT_FIELDS if getattr(args, f) is not None}
            key = add_tenant(args.config, args.name, args.tier, limits,
                             args.models.split(",") if args.models else None)
            print(f"tenant '{args.name}' added to {args.config}\nAPI key (shown once, store it now): {key}")
        else:
            cfg = parse_config(yaml.safe_load(args.config.read_text()))
            for t in sorted({t.name: t for t in cfg.tenants.values()}.values(), key=lambda t: t.name):
                print(f"{t.name:16} tier={t.tier:10} " + " ".join(f"{k}={v}" for k, v in t.limits.items()))
    except ConfigError as e:
        print(f"tenants: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

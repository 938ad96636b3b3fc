"""The tests' handle on a running stack: the product's `launcher.local.LocalStack` under the name the
integration tests use, and the product's Prometheus reader."""
from __future__ import annotations

from clients.prometheus import metric_value  # noqa: F401  (re-exported for the tests)
from launcher.local import HOST, LocalStack as TritonServer, free_port  # noqa: F401

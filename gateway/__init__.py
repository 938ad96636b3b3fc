"""The gateway: tenants and keys, routing, rate limits, admission and priority, the engine stream, metrics."""

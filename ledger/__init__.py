"""The usage ledger and the batch store: one record per finished gateway request, kept durably.

`record` (the one record schema), `spool` (the gateway's append-only local files; stdlib only, so the
Triton Python stub can import it), `store` (SQLite or PostgreSQL: usage, files, batches), `writer` (drains
the spool into the store), `reports` (per tenant / day / model aggregates). See docs/usage.md.
"""

"""OpenAI-style Batch API: input files, batch jobs and their lines in the ledger store (`batch.jobs`), and
the worker that runs lines through the gateway at the batch tier (`batch.worker`). See docs/usage.md."""

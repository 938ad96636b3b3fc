"""OpenAI-style Batch API: input files, batch jobs and their lines in the ledger store (`front.batch.jobs`), and
the worker that runs lines through the gateway at the batch tier (`front.batch.worker`). See docs/usage.md."""

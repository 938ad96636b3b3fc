"""The OpenAI-compatible front door (/v1/...) over the gateway."""

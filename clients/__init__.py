"""tritonclient-based client for the serving stack: typed API, typed errors, retries."""
from clients.llm import (
    AuthenticationError, BadRequestError, ContextTooLongError, GenerationResult, HTTPClient, LLMClient, LLMError,
    NotFoundError, OverloadedError, PermissionDeniedError, RateLimitError, with_retries,
)

__all__ = ["AuthenticationError", "BadRequestError", "ContextTooLongError", "GenerationResult", "HTTPClient", "LLMClient",
           "LLMError", "NotFoundError", "OverloadedError", "PermissionDeniedError", "RateLimitError",
           "with_retries"]

"""Text on the request path: tokenizing and the chat template (preprocessing), detokenizing (postprocessing)."""

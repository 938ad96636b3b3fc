"""Starts, supervises and stops the serving stack: tritonserver (internal) and the front (public)."""

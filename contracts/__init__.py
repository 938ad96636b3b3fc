"""Triton plumbing shared by every model: the tensor contracts, the error table, tensor helpers."""

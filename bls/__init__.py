"""Library behind the repository's Python models: tensor contracts, text processing, gateway logic.

Everything here is plain Python that tests import without Triton; the `model.py` files under
`model_repository/` are thin adapters over it.
"""

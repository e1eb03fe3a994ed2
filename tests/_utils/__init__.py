"""Helpers shared by unit, end-to-end and GPU tests (tiny models, the transformers oracle)."""

"""Evaluation tools run from the repo root: `python -m eval.<tool>`."""

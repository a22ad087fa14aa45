"""Pallas kernels, each beside its readable jnp reference and one dispatching entry point."""
